"""The app in-process (FastAPI TestClient), where a real process adds nothing: engine faults
(out of memory), readiness during start-up, auth modes, settings and the command line."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from server_testutils import metric, mm_ref, st_body, st_load

from moe_gemm_server import Settings, create_app
from moe_gemm_server.cli import build_parser, settings_from_args
from moe_gemm_server.engine import Engine, EngineOutOfMemory


class FlakyEngine(Engine):
    """Runs out of memory on launches over `limit` rows, like a GPU would."""

    def __init__(self, limit: int) -> None:
        super().__init__("cpu")
        self.limit = limit
        self.oom_launches = 0

    def grouped_mm_many(self, ws, requests, *, out_dtype=None):
        if sum(x.shape[0] for x, _ in requests) > self.limit:
            self.oom_launches += 1
            raise EngineOutOfMemory("out of memory on cuda:0: tried to allocate 80 GiB")
        return super().grouped_mm_many(ws, requests, out_dtype=out_dtype)


class SlowStartEngine(Engine):
    """Warm-up waits for a signal, so the test can look at the server while it is starting."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.release = threading.Event()

    def warm_up_grouped_gemm(self, dtypes=(torch.bfloat16,)):
        assert self.release.wait(30)
        super().warm_up_grouped_gemm(dtypes)


def _wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 30
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _post_concurrently(client: TestClient, url: str, bodies: list[bytes]) -> dict[int, object]:
    """POST every body at once (one thread each, so the batcher can merge them); i -> reply."""
    out: dict[int, object] = {}

    def send(i: int) -> None:
        out[i] = client.post(url, content=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _settings(tmp_path, **kw) -> Settings:
    return Settings(data_dir=tmp_path / "data", **kw)


def test_out_of_memory_answers_503_and_the_server_goes_on(tmp_path):
    engine = FlakyEngine(limit=100)
    app = create_app(_settings(tmp_path, batch_delay_us=300_000), engine=engine)
    w = torch.randn(2, 8, 4)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/m", content=st_body({"w": w})).status_code == 201
        big = torch.randn(150, 8)
        r = client.post("/v1/weights/m/grouped-mm", content=st_body(
            {"x": big, "counts": torch.tensor([100, 50], dtype=torch.int32)}))
        assert r.status_code == 503
        assert "out of memory" in r.json()["error"] and r.headers["retry-after"]
        # two requests that fit alone but not together: merged launch fails, each is retried
        xs = [torch.randn(60, 8), torch.randn(70, 8)]
        cs = [torch.tensor([30, 30], dtype=torch.int32), torch.tensor([0, 70], dtype=torch.int32)]
        out = _post_concurrently(client, "/v1/weights/m/grouped-mm",
                                 [st_body({"x": x, "counts": c}) for x, c in zip(xs, cs)])
        for i in range(2):
            assert out[i].status_code == 200, out[i].text
            torch.testing.assert_close(st_load(out[i].content)["y"].double(),
                                       mm_ref(xs[i], w, cs[i]), atol=1e-4, rtol=1e-4)
        assert engine.oom_launches == 2  # the solo 150 rows, the merged 130 rows
        assert client.get("/v2/health/ready").status_code == 200
        metrics = client.get("/metrics").text
        assert 'moe_gemm_rejections_total{reason="out_of_memory"} 1.0' in metrics
        assert 'moe_gemm_launch_errors_total{error="EngineOutOfMemory"} 2.0' in metrics


def test_not_ready_until_warm(tmp_path):
    engine = SlowStartEngine()
    app = create_app(_settings(tmp_path), engine=engine)
    with TestClient(app) as client:
        assert client.get("/v2/health/live").status_code == 200
        r = client.get("/v2/health/ready")
        assert r.status_code == 503 and r.json()["ready"] is False
        r = client.post("/v1/grouped-gemm", content=st_body(
            {"a.0": torch.randn(2, 2), "b.0": torch.randn(2, 2)}))
        assert r.status_code == 503 and "not ready" in r.json()["error"]
        engine.release.set()
        _wait_ready(client)
        r = client.post("/v1/grouped-gemm", content=st_body(
            {"a.0": torch.randn(2, 2), "b.0": torch.randn(2, 2)}))
        assert r.status_code == 200


def test_open_server_allows_everything(tmp_path):
    with TestClient(create_app(_settings(tmp_path))) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/o", content=st_body(
            {"w": torch.randn(1, 2, 2)})).status_code == 201
        assert client.get("/v1/weights").status_code == 200
        assert client.delete("/v1/weights/o").status_code == 200


def test_api_keys_without_admin_key_disable_weight_changes(tmp_path):
    with TestClient(create_app(_settings(tmp_path, api_key=["k1"]))) as client:
        _wait_ready(client)
        hdr = {"Authorization": "Bearer k1"}
        r = client.put("/v1/weights/o", content=st_body({"w": torch.randn(1, 2, 2)}),
                       headers=hdr)
        assert r.status_code == 403 and "admin" in r.json()["error"]
        assert client.get("/v1/weights", headers=hdr).status_code == 200
        assert client.get("/v1/weights").status_code == 401


def test_a_repeated_authorization_header_with_different_values_is_refused(tmp_path):
    # The first copy won: a request carrying a valid key and a wrong one was served.
    with TestClient(create_app(_settings(tmp_path, api_key=["k1"]))) as client:
        _wait_ready(client)
        two = [("authorization", "Bearer k1"), ("authorization", "Bearer nope")]
        r = client.get("/v1/weights", headers=two)
        assert r.status_code == 400
        assert r.json()["error"] == "authorization is given 2 times with different values"
        same = [("authorization", "Bearer k1"), ("authorization", " Bearer k1")]
        assert client.get("/v1/weights", headers=same).status_code == 200


def test_admin_key_only(tmp_path):
    """An admin key alone: reads and matmuls stay open, weight changes need the key."""
    with TestClient(create_app(_settings(tmp_path, admin_key="adm"))) as client:
        _wait_ready(client)
        body = st_body({"w": torch.randn(1, 2, 2)})
        assert client.put("/v1/weights/o", content=body).status_code == 401
        assert client.put("/v1/weights/o", content=body,
                          headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert client.put("/v1/weights/o", content=body,
                          headers={"Authorization": "Bearer adm"}).status_code == 201
        assert client.get("/v1/weights/o").status_code == 200


def test_unhandled_error_is_a_json_500(tmp_path, monkeypatch):
    app = create_app(_settings(tmp_path))
    with TestClient(app, raise_server_exceptions=False) as client:
        _wait_ready(client)
        import moe_gemm_server.routers.weights as weights_router

        def broken(*a, **k):
            raise RuntimeError("kaboom")

        monkeypatch.setattr(weights_router, "check_name", broken)
        r = client.put("/v1/weights/x", content=b"")
        assert r.status_code == 500
        assert "RuntimeError" in r.json()["error"] and r.json()["request_id"]
        assert r.headers["x-request-id"] == r.json()["request_id"]
        monkeypatch.undo()
        assert client.get("/v2/health/ready").status_code == 200


def test_a_cancelled_request_counts_as_499_not_500(tmp_path, caplog):
    """A request whose handler is cancelled from outside while its work is queued (by uvicorn
    at its graceful-shutdown timeout, by Ray Serve for a caller gone) wrote no answer, yet
    moe_gemm_requests_total and the access log counted it as status 500, a server error."""
    caplog.set_level(logging.INFO, logger="moe_gemm_server.access")
    # A 60 s batch delay: the request waits in the queue until it is cancelled.
    app = create_app(_settings(tmp_path, batch_delay_us=60_000_000))
    service = app.state.service
    body = st_body({"x": torch.randn(3, 8), "counts": torch.tensor([1, 2], dtype=torch.int32)})

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            deadline = time.monotonic() + 30
            while not service.ready:
                assert time.monotonic() < deadline, "never ready"
                await asyncio.sleep(0.005)
            # (httpx's ASGI transport runs the app in the caller's task: cancelling the call
            # cancels the handler, as uvicorn or Ray Serve do)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test") as client:
                r = await client.put("/v1/weights/m", content=st_body({"w": torch.randn(2, 8, 4)}))
                assert r.status_code == 201, r.text
                call = asyncio.ensure_future(client.post("/v1/weights/m/grouped-mm", content=body))
                while service.batcher.queued < 1:
                    assert time.monotonic() < deadline and not call.done(), "never queued"
                    await asyncio.sleep(0.005)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call

    asyncio.run(scenario())
    text = service.metrics.render().decode()
    assert metric(text, "moe_gemm_rejections_total", reason="cancelled") == 1
    route = {"route": "/v1/weights/{name}/grouped-mm", "method": "POST"}
    assert metric(text, "moe_gemm_requests_total", **route, status="499") == 1, text
    assert metric(text, "moe_gemm_requests_total", **route, status="500") == 0, text
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_gemm_server.access"]
    assert any(line.startswith("POST /v1/weights/m/grouped-mm 499 ") for line in lines), lines


class BuggyEngine(Engine):
    """add_weights fails in a way no check foresaw, for the set named "buggy"."""

    def add_weights(self, name, *args, **kwargs):
        if name == "buggy":
            raise KeyError("an unforeseen bug")
        return super().add_weights(name, *args, **kwargs)


def test_files_that_cannot_be_loaded_are_skipped_and_the_server_gets_ready(tmp_path):
    """A header nested 100000 deep beside a valid file (a RecursionError escaped the loader:
    not ready for ever), and any other per-file failure, is logged and skipped. A stored file
    with a NaN (acknowledged before uploads were checked for them) is served as stored."""
    import struct

    from safetensors.torch import save

    data = tmp_path / "data"
    data.mkdir()
    header = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (data / "deep.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    w = torch.randn(2, 4, 3)
    (data / "fine.safetensors").write_bytes(save({"w": w}))
    (data / "buggy.safetensors").write_bytes(save({"w": w}))
    nan = w.clone()
    nan[0, 0, 0] = float("nan")
    (data / "nan.safetensors").write_bytes(save({"w": nan}))
    app = create_app(_settings(tmp_path), engine=BuggyEngine("cpu"))
    with TestClient(app) as client:
        _wait_ready(client)
        names = [i["name"] for i in client.get("/v1/weights").json()["weights"]]
        assert names == ["fine", "nan"]
        x, counts = torch.randn(3, 4), torch.tensor([1, 2])
        r = client.post("/v1/weights/fine/grouped-mm", content=st_body({"x": x, "counts": counts}))
        assert torch.allclose(st_load(r.content)["y"].double(), mm_ref(x, w, counts), atol=1e-4)
        errors = app.state.service.load_errors
        assert sorted(errors) == ["buggy", "deep"]
        assert "nested too deeply" in errors["deep"] and "KeyError" in errors["buggy"]


def test_a_start_up_that_fails_as_a_whole_says_why(tmp_path, monkeypatch):
    """An error outside any one file (here: the directory cannot be listed) used to end the
    load task silently, readiness saying "loading" for ever."""
    from moe_gemm_server.storage import WeightStore

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self.root))

    monkeypatch.setattr(WeightStore, "names", unreadable)
    with TestClient(create_app(_settings(tmp_path))) as client:
        deadline = time.monotonic() + 30
        while "start-up failed" not in client.get("/v2/health/ready").json()["error"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = client.get("/v2/health/ready")
        assert r.status_code == 503 and "PermissionError" in r.json()["error"]


def test_a_leftover_upload_that_cannot_be_removed_does_not_keep_the_server_unready(tmp_path):
    """A partial-upload name the start cannot remove (here a directory; also another user's
    file in a sticky directory, or an I/O error) is logged and left: the server used to stay
    not ready for good ("start-up failed (IsADirectoryError ...)")."""
    from safetensors.torch import save

    data = tmp_path / "data"
    (data / ".upload-stuck.tmp").mkdir(parents=True)
    (data / ".upload-crashed.tmp").write_bytes(b"half")
    w = torch.randn(2, 4, 3)
    (data / "fine.safetensors").write_bytes(save({"w": w}))
    with TestClient(create_app(_settings(tmp_path), engine=Engine("cpu"))) as client:
        _wait_ready(client)
        names = [i["name"] for i in client.get("/v1/weights").json()["weights"]]
        assert names == ["fine"]
    assert sorted(p.name for p in data.iterdir()) == [".upload-stuck.tmp", "fine.safetensors"]


def test_an_upload_of_many_tensors_is_refused_with_a_short_message(tmp_path):
    """A weight upload holds two tensors at most: one of 20000 is a 422 whose message counts
    them and names a few (it used to quote every name: a 200 kB error, and every entry was
    checked first)."""
    w = torch.randn(2, 4, 3)
    tensors = {"w": w, **{f"extra{i}": torch.zeros(1) for i in range(20000)}}
    with TestClient(create_app(_settings(tmp_path), engine=Engine("cpu"))) as client:
        _wait_ready(client)
        r = client.put("/v1/weights/many", content=st_body(tensors))
        assert r.status_code == 422, r.text[:300]
        error = r.json()["error"]
        assert "20001 tensors" in error and len(error) < 400, error[:300]
        r = client.put("/v1/weights/two", content=st_body({"w": w, "w_t": w.clone()}))
        assert r.status_code == 422 and "['w', 'w_t']" in r.json()["error"]
        assert client.get("/v1/weights").json()["weights"] == []


def test_a_directory_at_a_sets_file_name_is_a_409_not_a_storage_failure(tmp_path):
    """A directory made by hand at <name>.safetensors is no set (the listing skips it, GET is
    404); a PUT of that name could not rename its upload over it and a DELETE could not
    remove it, each answered 507 "data directory cannot be written (Is a directory)": a 409
    naming the entry now, and the directory is left alone. Other names work as ever."""
    data = tmp_path / "data"
    (data / "blocked.safetensors").mkdir(parents=True)
    (data / "blocked.safetensors" / "keep").write_text("x")
    w = torch.randn(2, 4, 3)
    with TestClient(create_app(_settings(tmp_path), engine=Engine("cpu"))) as client:
        _wait_ready(client)
        assert client.get("/v1/weights").json()["weights"] == []
        assert client.get("/v1/weights/blocked").status_code == 404
        r = client.put("/v1/weights/blocked", content=st_body({"w": w}))
        assert r.status_code == 409, r.text
        assert "a directory at blocked.safetensors" in r.json()["error"]
        r = client.delete("/v1/weights/blocked")
        assert r.status_code == 409 and "nothing was deleted" in r.json()["error"], r.text
        assert (data / "blocked.safetensors" / "keep").read_text() == "x"
        assert client.put("/v1/weights/free", content=st_body({"w": w})).status_code == 201
        assert client.delete("/v1/weights/free").status_code in (200, 204)
        assert not list(data.glob(".*"))  # (no upload's temp file left behind)


# --------------------------------------------------------------------------- settings, CLI


def test_settings_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_GEMM_PORT", "9001")
    monkeypatch.setenv("MOE_GEMM_API_KEY", "a, b")
    monkeypatch.setenv("MOE_GEMM_MAX_BODY_BYTES", "1234")
    monkeypatch.setenv("MOE_GEMM_BATCHING", "false")
    monkeypatch.setenv("MOE_GEMM_WARMUP_ROWS", "1,8")
    monkeypatch.setenv("MOE_GEMM_DATA_DIR", str(tmp_path))
    s = Settings()
    assert (s.port, s.api_key, s.max_body_bytes) == (9001, ["a", "b"], 1234)
    assert s.batching is False and s.max_batch_requests == 1
    assert s.warmup_rows == [1, 8] and s.data_dir == tmp_path
    # flags beat the environment
    s = settings_from_args(["--port", "9002", "--api-key", "z", "--batching"])
    assert (s.port, s.api_key, s.batching) == (9002, ["z"], True)


def test_settings_defaults_are_safe():
    s = Settings(_env_file=None)
    assert s.host == "127.0.0.1" and s.port == 8000
    assert s.max_body_bytes == 64 << 20 and s.api_key == [] and s.admin_key is None
    assert s.max_queue > 0 and s.max_rows > 0 and s.max_flops > 0
    assert 0 < s.body_timeout_s <= 300  # a stalled body is cut, but not a slow upload


def test_cli_rejects_bad_values(capsys):
    with pytest.raises(SystemExit):
        settings_from_args(["--port", "70000"])
    with pytest.raises(SystemExit):
        settings_from_args(["--max-queue", "0"])
    with pytest.raises(SystemExit):
        settings_from_args(["--body-timeout-s", "0"])
    assert settings_from_args(["--body-timeout-s", "2.5"]).body_timeout_s == 2.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--backend", "magic"])
    flags = build_parser().format_help()
    for flag in ("--host", "--port", "--data-dir", "--api-key", "--admin-key",
                 "--max-body-bytes", "--max-rows", "--max-flops", "--log-level",
                 "--batch-delay-us", "--max-queue", "--no-batching", "--body-timeout-s"):
        assert flag in flags


def test_json_answers_are_bounded(tmp_path):
    """A JSON request whose answer would hold more than 4M numbers is refused up front (422);
    the same request in safetensors is served."""
    with TestClient(create_app(_settings(tmp_path))) as client:
        _wait_ready(client)
        w = torch.randn(1, 1, 4096)
        assert client.put("/v1/weights/wide", content=st_body({"w": w})).status_code == 201
        x = torch.randn(1025, 1)
        r = client.post("/v1/weights/wide/grouped-mm",
                        json={"x": x.tolist(), "counts": [1025]})
        assert r.status_code == 422 and "safetensors" in r.json()["error"]
        r = client.post("/v1/weights/wide/grouped-mm", content=st_body(
            {"x": x, "counts": torch.tensor([1025], dtype=torch.int32)}))
        assert r.status_code == 200
        torch.testing.assert_close(st_load(r.content)["y"], x @ w[0], atol=1e-5, rtol=1e-5)
        small = client.post("/v1/weights/wide/grouped-mm",
                            json={"x": x[:20].tolist(), "counts": [20]})
        assert small.status_code == 200 and len(small.json()["y"]) == 20


def test_cli_fails_fast_with_one_line(tmp_path):
    import logging

    from moe_gemm_server.cli import main

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        # (--port 0: a server on 8000, `make serve`, would make the bind the refusal)
        with pytest.raises(SystemExit, match="moe-gemm-server: device must be .*'tpu'"):
            main(["--device", "tpu", "--port", "0", "--data-dir", str(tmp_path / "d")])
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        with pytest.raises(SystemExit, match="moe-gemm-server: .*file"):
            main(["--port", "0", "--data-dir", str(blocker / "data")])
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)


class PoisonEngine(Engine):
    """A launch holding a request of 13 rows fails (as a launch the checks let through
    might); every other launch runs."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.failed_launches = 0

    def grouped_mm_many(self, ws, requests, *, out_dtype=None):
        if any(x.shape[0] == 13 for x, _ in requests):
            self.failed_launches += 1
            raise RuntimeError("launch failed")
        return super().grouped_mm_many(ws, requests, out_dtype=out_dtype)


def test_a_failing_request_does_not_fail_the_others_merged_with_it(tmp_path):
    engine = PoisonEngine()
    app = create_app(_settings(tmp_path, batch_delay_us=300_000), engine=engine)
    w = torch.randn(2, 8, 4)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/m", content=st_body({"w": w})).status_code == 201
        rows = [20, 13, 30]
        xs = [torch.randn(m, 8) for m in rows]
        cs = [torch.tensor([m // 2, m - m // 2], dtype=torch.int32) for m in rows]
        out = _post_concurrently(client, "/v1/weights/m/grouped-mm",
                                 [st_body({"x": x, "counts": c}) for x, c in zip(xs, cs)])
        assert out[1].status_code == 500 and "RuntimeError" in out[1].json()["error"]
        for i in (0, 2):
            assert out[i].status_code == 200, out[i].text
            torch.testing.assert_close(st_load(out[i].content)["y"].double(),
                                       mm_ref(xs[i], w, cs[i]), atol=1e-4, rtol=1e-4)
        assert engine.failed_launches == 2  # the merged launch, then the 13-row one alone
        assert client.get("/v2/health/ready").status_code == 200


def _raw_st(header: dict, data: bytes = b"") -> bytes:
    import json
    import struct

    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def test_hostile_inputs_get_4xx_with_a_json_error(tmp_path):
    app = create_app(_settings(tmp_path))
    w = torch.randn(4, 32, 4)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/m", content=st_body({"w": w})).status_code == 201
        x = torch.randn(10, 32)

        def mm(body, **headers):
            return client.post("/v1/weights/m/grouped-mm", content=body, headers=headers)

        # int64 counts whose sum wraps around to T
        big = torch.tensor([3, 2**63 - 2**32, 2**63 - 2**32, 2**33 + 7], dtype=torch.int64)
        r = mm(st_body({"x": x, "counts": big}))
        assert r.status_code == 422 and "counts must be <= T = 10" in r.json()["error"]
        offs = torch.tensor([2**62, -2**63 + 5, 3, 10], dtype=torch.int64)
        r = mm(st_body({"x": x, "offs": offs}))
        assert r.status_code == 422 and "offs must" in r.json()["error"]
        # a K=0 problem has no FLOPs but a 2 GiB answer
        body = st_body({"a.0": torch.zeros(8, 0), "b.0": torch.zeros(0, 1 << 26)})
        r = client.post("/v1/grouped-gemm", content=body)
        assert r.status_code == 422 and "--max-output-bytes" in r.json()["error"]
        # zero-size tensors declaring dimensions past int64 / int32
        for shape in ([2**64, 0], [2**32, 2**32, 0]):
            body = _raw_st({"a.0": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]},
                            "b.0": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]}})
            r = client.post("/v1/grouped-gemm", content=body)
            assert r.status_code == 400 and "shape must be a list of ints in" in r.json()["error"]
        # JSON: an integer beyond float64, a body nested past the parser's recursion limit
        js = {"content-type": "application/json"}
        r = client.post("/v1/weights/m/grouped-mm", headers=js,
                        content=b'{"x": [[' + b"1" * 400 + b"]], \"counts\": [1, 0, 0, 0]}")
        assert r.status_code == 400 and "float64" in r.json()["error"]
        r = client.post("/v1/weights/m/grouped-mm", headers=js,
                        content=b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        assert r.status_code == 400 and "JSON" in r.json()["error"]
        # timeouts: a number too long for a float, digits with underscores
        ok_body = st_body({"x": x, "counts": torch.tensor([1, 2, 3, 4], dtype=torch.int32)})
        for bad in ("1" + "0" * 400, "1_000_000", "+5"):
            r = mm(ok_body, **{"x-timeout-us": bad})
            assert r.status_code == 400 and "x-timeout-us must be" in r.json()["error"], bad
        assert mm(ok_body, **{"x-timeout-us": "999999999999999999"}).status_code == 200
        # leading zeros keep a value below 10^18 (refused by its digit count before)
        assert mm(ok_body, **{"x-timeout-us": "000000000000000001000000"}).status_code == 200
        assert mm(ok_body, **{"x-priority": "0000000000000000005"}).status_code == 200
        r = mm(ok_body, **{"x-timeout-us": "0" + "1" + "0" * 18})
        assert r.status_code == 400 and "below 10^18" in r.json()["error"]
        # a header given twice: the same value is one value, different values are a 400
        for name, values, status, words in (
                ("x-priority", ("1", "1"), 200, ""),
                # (one value written two ways: compared as numbers)
                ("x-priority", ("5", "05"), 200, ""),
                ("x-priority", ("1", "bogus"), 400, "x-priority must be a non-negative"),
                ("x-timeout-us", ("5000000", "1"), 400, "x-timeout-us is given 2 times")):
            r = client.post("/v1/weights/m/grouped-mm", content=ok_body,
                            headers=[(name, v) for v in values])
            assert r.status_code == status, (name, values, r.text)
            if status == 400:
                assert words in r.json()["error"]
        # v2: a value that does not fit the declared INT32, a shape past int32
        req = {"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [10, 32], "data": x.tolist()},
            {"name": "counts", "datatype": "INT32", "shape": [4], "data": [2**32 + 3, 0, 5, 2]}]}
        r = client.post("/v2/models/m/infer", json=req)
        assert r.status_code == 400 and "does not fit INT32" in r.json()["error"]
        req["inputs"][1]["data"] = [3, 0, 5, 2]
        req["parameters"] = {"timeout": 10**400}
        r = client.post("/v2/models/m/infer", json=req)
        # (was a 500; then served as no timeout, where X-Timeout-Us was a 400: now as the header)
        assert r.status_code == 400 and "below 10^18" in r.json()["error"], r.text
        req["parameters"] = {"timeout": 10**18 - 1}  # beyond any wait: no timeout
        r = client.post("/v2/models/m/infer", json=req)
        assert r.status_code == 200, r.text
        req.pop("parameters")
        req["inputs"][0] = {"name": "x", "datatype": "FP32", "shape": [2**63, 0], "data": []}
        r = client.post("/v2/models/m/infer", json=req)
        assert r.status_code == 400 and "dimension over" in r.json()["error"]


def test_request_metrics_label_unknown_methods_other(tmp_path):
    """The method label is bounded: any method token outside the standard ones (h11, uvicorn's
    parser without httptools, takes them all; the route answers 405) is counted as "other".
    Labelled as sent, each new token made a counter and a latency histogram of its own, ~19
    series that anyone could create without a key: /metrics and the process grew without
    bound."""
    with TestClient(create_app(_settings(tmp_path, api_key=["k1"]))) as client:
        _wait_ready(client)
        for i in range(40):
            r = client.request(f"M{i}", "/v1/weights/x/grouped-mm")
            assert r.status_code == 405
        assert client.request("PUT", "/v1/weights/x/grouped-mm").status_code == 405
        text = client.get("/metrics").text
    assert 'method="M' not in text
    assert metric(text, "moe_gemm_requests_total", route="/v1/weights/{name}/grouped-mm",
                  method="other", status="405") == 40
    assert metric(text, "moe_gemm_requests_total", route="/v1/weights/{name}/grouped-mm",
                  method="PUT", status="405") == 1
