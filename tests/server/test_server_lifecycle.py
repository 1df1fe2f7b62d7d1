"""Process lifecycle: restarts keep weights, SIGKILL mid-upload loses nothing, SIGTERM drains."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import torch
from server_testutils import LiveServer, metric, mm_ref, read_http_response, st_body, st_load

ADMIN = {"Authorization": "Bearer adm"}


def _mm(url: str, name: str, x: torch.Tensor, c: torch.Tensor) -> httpx.Response:
    return httpx.post(f"{url}/v1/weights/{name}/grouped-mm", timeout=60,
                      content=st_body({"x": x, "counts": c}))


def test_restart_keeps_every_acknowledged_upload(tmp_path):
    data = tmp_path / "data"
    gen = torch.Generator().manual_seed(41)
    sets = {
        "keep-a": ({"w": torch.randn(3, 16, 8, generator=gen)}, "w"),
        "keep.b": ({"w_t": torch.randn(2, 8, 16, generator=gen).to(torch.bfloat16)}, "w_t"),
        "keep_c": ({"w": torch.randn(4, 16, 24, generator=gen).to(torch.float16)}, "w"),
    }
    x = torch.randn(6, 16, generator=gen)
    answers = {}
    server = LiveServer(data, "--admin-key", "adm", "--log-level", "warning").start()
    try:
        for name, (tensors, _) in sets.items():
            r = httpx.put(f"{server.url}/v1/weights/{name}", content=st_body(tensors),
                          headers=ADMIN, timeout=60)
            assert r.status_code == 201, r.text
        # a replaced set keeps its latest version, a deleted one stays deleted
        r = httpx.put(f"{server.url}/v1/weights/gone", content=st_body(
            {"w": torch.randn(1, 2, 2)}), headers=ADMIN, timeout=60)
        assert r.status_code == 201
        assert httpx.delete(f"{server.url}/v1/weights/gone", headers=ADMIN).status_code == 200
        listing = httpx.get(f"{server.url}/v1/weights").json()["weights"]
        for name, (tensors, _) in sets.items():
            w = next(iter(tensors.values()))
            E = w.shape[0]
            c = torch.zeros(E, dtype=torch.int32)
            c[0], c[E - 1] = 2, 4
            xx = x.to(w.dtype)
            answers[name] = st_load(_mm(server.url, name, xx, c).content)["y"]
    finally:
        assert server.stop() == 0
    server2 = LiveServer(data, "--admin-key", "adm", "--log-level", "warning").start()
    try:
        assert httpx.get(f"{server2.url}/v1/weights").json()["weights"] == listing
        assert httpx.get(f"{server2.url}/v1/weights/gone").status_code == 404
        for name, (tensors, layout) in sets.items():
            w = next(iter(tensors.values()))
            E = w.shape[0]
            c = torch.zeros(E, dtype=torch.int32)
            c[0], c[E - 1] = 2, 4
            y = st_load(_mm(server2.url, name, x.to(w.dtype), c).content)["y"]
            assert torch.equal(y, answers[name])
            wk = w if layout == "w" else w.transpose(1, 2)
            ref = mm_ref(x.to(w.dtype), wk, c)
            assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    finally:
        server2.stop()
    assert sorted(p.name for p in data.iterdir()) == [
        "keep-a.safetensors", "keep.b.safetensors", "keep_c.safetensors"]


def test_sigkill_mid_upload_leaves_previous_weights(tmp_path):
    data = tmp_path / "data"
    gen = torch.Generator().manual_seed(42)
    w_old = torch.randn(4, 32, 16, generator=gen)
    server = LiveServer(data, "--admin-key", "adm", "--log-level", "warning").start()
    try:
        r = httpx.put(f"{server.url}/v1/weights/m", content=st_body({"w": w_old}),
                      headers=ADMIN, timeout=60)
        assert r.status_code == 201
        old_bytes = (data / "m.safetensors").read_bytes()
        # start replacing it with a 8 MB body, send half, then kill the server
        new_body = st_body({"w": torch.randn(64, 256, 128, generator=gen)})
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        head = (f"PUT /v1/weights/m HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer adm\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {len(new_body)}"
                "\r\n\r\n")
        sock.sendall(head.encode() + new_body[: len(new_body) // 2])
        deadline = time.monotonic() + 10
        while not any(p.name.startswith(".upload-") for p in data.iterdir()):
            assert time.monotonic() < deadline, "the upload never reached the disk"
            time.sleep(0.01)
        server.kill()  # SIGKILL
        sock.close()
        assert (data / "m.safetensors").read_bytes() == old_bytes
    finally:
        server.stop()
    server2 = LiveServer(data, "--admin-key", "adm", "--log-level", "warning").start()
    try:
        info = httpx.get(f"{server2.url}/v1/weights/m").json()
        assert (info["experts"], info["k"], info["n"]) == (4, 32, 16)
        x = torch.randn(5, 32, generator=gen)
        c = torch.tensor([1, 0, 4, 0], dtype=torch.int32)
        y = st_load(_mm(server2.url, "m", x, c).content)["y"]
        torch.testing.assert_close(y.double(), mm_ref(x, w_old, c), atol=1e-4, rtol=1e-4)
    finally:
        server2.stop()
    # the partial upload was removed at start: no half file anywhere
    assert sorted(p.name for p in data.iterdir()) == ["m.safetensors"]


def test_corrupt_weight_file_is_skipped_not_fatal(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "broken.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}garbage")
    from safetensors.torch import save

    (data / "fine.safetensors").write_bytes(save({"w": torch.randn(2, 4, 4)}))
    server = LiveServer(data, "--log-level", "warning").start()
    try:
        names = [i["name"] for i in httpx.get(f"{server.url}/v1/weights").json()["weights"]]
        assert names == ["fine"]
        assert metric(httpx.get(f"{server.url}/metrics").text,
                      "moe_gemm_weight_load_errors_total") == 1
    finally:
        server.stop()
    assert "broken" in server.log()


def test_sigterm_drains_queued_work_then_exits(tmp_path):
    """SIGTERM with three requests queued (1 s batch delay) and one still uploading: readiness
    turns 503 and newcomers get 503 while the server keeps listening; the queued requests run
    at once (the delay is not waited out), the upload in progress is served, then exit 0."""
    data = tmp_path / "data"
    server = LiveServer(data, "--batch-delay-us", "1000000", "--log-level", "info").start()
    gen = torch.Generator().manual_seed(43)
    w = torch.randn(3, 16, 8, generator=gen)
    try:
        r = httpx.put(f"{server.url}/v1/weights/d", content=st_body({"w": w}), timeout=60)
        assert r.status_code == 201
        reqs = [(torch.randn(T, 16, generator=gen), torch.tensor([T, 0, 0], dtype=torch.int32))
                for T in (1, 4, 9)]
        results: dict[int, httpx.Response] = {}

        def send(i: int) -> None:
            results[i] = _mm(server.url, "d", *reqs[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        # one more request whose body is only half sent when the signal comes
        x_up = torch.randn(5, 16, generator=gen)
        c_up = torch.tensor([2, 3, 0], dtype=torch.int32)
        body = st_body({"x": x_up, "counts": c_up})
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        head = (f"POST /v1/weights/d/grouped-mm HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        sock.sendall(head.encode() + body[:100])
        deadline = time.monotonic() + 10
        while True:
            m = httpx.get(f"{server.url}/metrics").text
            # 3 queued; in flight: 3 queued + the upload + this metrics request
            if (metric(m, "moe_gemm_queued_requests") >= 3
                    and metric(m, "moe_gemm_requests_in_flight") >= 5):
                break
            assert time.monotonic() < deadline, "requests did not queue"
            time.sleep(0.01)
        t_term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:
            r = httpx.get(f"{server.url}/v2/health/ready", timeout=5)
            if r.status_code == 503:
                break
            assert time.monotonic() < deadline, "readiness never turned 503"
            time.sleep(0.01)
        assert "draining" in r.json()["error"]
        assert httpx.get(f"{server.url}/v2/health/live", timeout=5).status_code == 200
        late = _mm(server.url, "d", *reqs[0])
        assert late.status_code == 503 and "draining" in late.json()["error"]
        assert "retry-after" in late.headers
        for t in threads:
            t.join(30)
        # queued work finished without waiting out the 1 s batch delay
        assert time.monotonic() - t_term < 1.0
        for i, (x, c) in enumerate(reqs):
            assert results[i].status_code == 200, results[i].text
            y = st_load(results[i].content)["y"]
            torch.testing.assert_close(y.double(), mm_ref(x, w, c), atol=1e-4, rtol=1e-4)
        assert server.proc.poll() is None  # still waiting for the upload in progress
        sock.sendall(body[100:])
        status, _, payload = read_http_response(sock)
        sock.close()
        assert status == 200
        torch.testing.assert_close(st_load(payload)["y"].double(), mm_ref(x_up, w, c_up),
                                   atol=1e-4, rtol=1e-4)
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
    assert "draining" in server.log()


def test_second_sigterm_stops_at_once(tmp_path):
    """A second signal does not wait for a request still arriving (a body that trickles in,
    byte by byte, never stalls long enough for --body-timeout-s), nor for the drain timeout."""
    server = LiveServer(tmp_path / "data", "--drain-timeout-s", "20").start()
    stop = threading.Event()
    try:
        # (a weight set's header, which the server takes, then its data a byte at a time: an
        # upload whose first bytes are no header it takes is answered from them at once)
        body = st_body({"w": torch.zeros(1, 250, 100)})
        head = 8 + int.from_bytes(body[:8], "little")
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"PUT /v1/weights/slow HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body[:head + 100])

        def trickle() -> None:
            while not stop.wait(0.2):
                try:
                    sock.sendall(b"a")
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "readiness never turned 503"
            time.sleep(0.01)
        assert server.proc.poll() is None  # the first signal waits for the upload
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=30)
        assert time.monotonic() - t0 < 5, server.log()[-2000:]
    finally:
        stop.set()
        server.stop()


def test_work_left_when_the_drain_times_out_is_answered_503_not_500(tmp_path):
    """SIGTERM with --drain-timeout-s 0 and several slow requests queued: each is answered,
    200 with its right result or a JSON 503 saying the server drains (a client retries that
    elsewhere), never uvicorn's plain-text 500 for a request it cancelled at shutdown."""
    # One request per launch, each ~34 GFLOP (a second or more on the CPU backend) with a
    # 16 MB body, so that requests wait in the queue however fast the machine uploads.
    server = LiveServer(tmp_path / "data", "--drain-timeout-s", "0", "--max-body-bytes",
                        str(64 << 20), "--max-rows", "8192", "--max-flops", str(1 << 40),
                        "--max-batch-requests", "1", "--log-level", "warning").start()
    gen = torch.Generator().manual_seed(44)
    w = torch.randn(1, 1024, 4096, generator=gen)
    x = torch.randn(4096, 1024, generator=gen)
    c = torch.tensor([4096], dtype=torch.int32)
    results: dict[int, httpx.Response] = {}
    try:
        r = httpx.put(f"{server.url}/v1/weights/slow", content=st_body({"w": w}), timeout=60)
        assert r.status_code == 201, r.text

        def send(i: int) -> None:
            results[i] = _mm(server.url, "slow", x, c)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while metric(httpx.get(f"{server.url}/metrics").text, "moe_gemm_queued_requests") < 2:
            assert time.monotonic() < deadline, "requests did not queue"
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    ref = mm_ref(x, w, c)
    refused = 0
    for i, r in results.items():
        if r.status_code == 200:
            y = st_load(r.content)["y"].double()
            assert (y - ref).abs().max() <= 1e-3 * ref.abs().max(), i
        else:
            assert r.status_code == 503, (i, r.status_code, r.text[:200])
            assert "draining" in r.json()["error"] and "retry-after" in r.headers
            refused += 1
    # (at least one of the two or more queued at the signal: one may have started and finished
    # between the metric's read and the signal)
    assert len(results) == 6 and refused >= 1


def _trickle(sock: socket.socket, rest: bytes, stop: threading.Event) -> threading.Thread:
    """Sends `rest` one byte every 0.1 s (never a pause near --body-timeout-s) until stopped."""

    def run() -> None:
        for i in range(len(rest)):
            if stop.wait(0.1):
                return
            try:
                sock.sendall(rest[i:i + 1])
            except OSError:
                return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_body_still_arriving_when_the_drain_times_out_is_answered_503(tmp_path):
    """SIGTERM while two bodies trickle in, a matmul and an upload replacing an acknowledged
    set: each is given --drain-timeout-s to arrive, then answered a JSON 503 with Retry-After
    (it was uvicorn's plain-text 500, once its graceful-shutdown timeout cancelled the
    request). The acknowledged set is kept as it was, no partial upload is left behind, and
    the process exits 0."""
    data = tmp_path / "data"
    drain_s = 1.0
    server = LiveServer(data, "--drain-timeout-s", str(drain_s), "--log-level", "info").start()
    gen = torch.Generator().manual_seed(45)
    w = torch.randn(3, 16, 8, generator=gen)
    stop = threading.Event()
    socks: dict[str, socket.socket] = {}
    try:
        r = httpx.put(f"{server.url}/v1/weights/keep", content=st_body({"w": w}), timeout=60)
        assert r.status_code == 201, r.text
        acknowledged = (data / "keep.safetensors").read_bytes()
        bodies = {
            "/v1/weights/keep/grouped-mm": ("POST", st_body(
                {"x": torch.randn(5, 16, generator=gen),
                 "counts": torch.tensor([2, 3, 0], dtype=torch.int32)})),
            "/v1/weights/keep": ("PUT", st_body({"w": torch.randn(3, 16, 8, generator=gen)})),
        }
        for path, (method, body) in bodies.items():
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}"
                         f"\r\nX-Request-Id: slow-{method}\r\n\r\n".encode() + body[:100])
            socks[method] = sock
            _trickle(sock, body[100:], stop)
        deadline = time.monotonic() + 10
        while metric(httpx.get(f"{server.url}/metrics").text,
                     "moe_gemm_requests_in_flight") < 3:  # the two bodies + this request
            assert time.monotonic() < deadline, "the requests never arrived"
            time.sleep(0.01)
        t_term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for method, sock in socks.items():
            status, headers, payload = read_http_response(sock)
            waited = time.monotonic() - t_term
            assert status == 503, (method, status, payload[:300])
            error = json.loads(payload)
            assert "draining" in error["error"] and error["request_id"] == f"slow-{method}"
            assert headers["retry-after"] == "1" and headers.get("connection") == "close"
            # (given the drain's time to arrive, then answered without waiting for more)
            assert drain_s * 0.9 <= waited < drain_s + 5, (method, waited)
        assert server.proc.wait(timeout=30) == 0
    finally:
        stop.set()
        for sock in socks.values():
            sock.close()
        server.stop()
    log = server.log()
    assert "Internal Server Error" not in log and "Exception in ASGI application" not in log
    assert "POST /v1/weights/keep/grouped-mm 503 " in log and "PUT /v1/weights/keep 503 " in log
    assert "audit action=put_weights name=keep outcome=refused status=503 " in log
    assert (data / "keep.safetensors").read_bytes() == acknowledged
    assert not list(data.glob(".upload-*"))
