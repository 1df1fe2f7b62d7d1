"""Fault tolerance of one server: sticky device errors (not ready, exit 70, weights kept), the
resident-memory budget (507), concurrent uploads of one name, and a full disk during upload."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from server_testutils import REPO, LiveServer, free_port, metric, mm_ref, st_body, st_load

from moe_gemm_server import Settings, create_app
from moe_gemm_server import service_weights as service_mod
from moe_gemm_server import storage as storage_mod
from moe_gemm_server.engine import Engine, EngineOutOfMemory
from moe_gemm_server.errors import APIError
from moe_gemm_server.faults import EXIT_DEVICE_FAILED, device_failure, is_no_space

ILLEGAL = "CUDA error: an illegal memory access was encountered"


# ------------------------------------------------------------------------------ detection


@pytest.mark.parametrize("exc", [
    RuntimeError(ILLEGAL + "\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"),
    RuntimeError("cudaErrorIllegalInstruction"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA error: misaligned address"),
    RuntimeError("CUDA error: unspecified launch failure"),
    RuntimeError("CUDA error: uncorrectable ECC error encountered"),
])
def test_sticky_errors_are_recognised(exc: BaseException) -> None:
    reason = device_failure(exc)
    assert reason is not None and reason.startswith("RuntimeError: ") and "\n" not in reason


def test_sticky_error_found_through_the_cause_chain() -> None:
    try:
        try:
            raise RuntimeError(ILLEGAL)
        except RuntimeError as inner:
            raise ValueError("launch failed") from inner
    except ValueError as outer:
        assert device_failure(outer) == f"RuntimeError: {ILLEGAL}"


@pytest.mark.parametrize("exc", [
    EngineOutOfMemory("out of memory on cuda:0: CUDA out of memory. Tried to allocate 2 GiB"),
    RuntimeError("CUDA error: out of memory"),
    ValueError("x must be (T, K) = (T, 8)"),
    OSError(errno.ENOSPC, "No space left on device"),
    # client-chosen text in the server's own refusals and in paths is no device error
    APIError(422, "expected one tensor, 'w' (E, K, N) or 'w_t' (E, N, K); got "
                  "['illegal address']"),
    APIError(507, "weight set 'illegal_address' needs 4096 bytes"),
    OSError(errno.ENOENT, "No such file or directory", "/data/launch_failed.safetensors"),
])
def test_recoverable_errors_are_not_sticky(exc: BaseException) -> None:
    assert device_failure(exc) is None


def test_a_refusal_is_not_read_through_its_context() -> None:
    try:
        try:
            raise ValueError("input_value='device-side assert triggered'")  # (pydantic's text)
        except ValueError:
            raise APIError(400, "'w' must be a rectangular 3-D nested list of numbers") from None
    except APIError as refusal:
        assert device_failure(refusal) is None


def test_uploads_naming_a_sticky_error_are_refused_not_fatal(tmp_path: Path) -> None:
    """A client's tensor name or set name that reads like a CUDA error is a 4xx, not a
    device failure: the server stays ready (it used to exit 70, and to fail every restart)."""
    settings = Settings(data_dir=tmp_path, max_resident_bytes=1000)
    with TestClient(create_app(settings, engine=Engine("cpu", warmup_rows=[1]))) as client:
        _wait_ready(client)
        r = client.put("/v1/weights/x", content=st_body({"illegal address": torch.ones(1)}))
        assert r.status_code == 422, r.text
        r = client.put("/v1/weights/x", content=b"{}",
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 422
        r = client.put("/v1/weights/x", json={"w": [[["device-side assert triggered"]]]})
        assert r.status_code == 400, r.text
        r = client.put("/v1/weights/illegal_address",
                       content=st_body({"w": torch.randn(4, 16, 16)}))  # over the budget
        assert r.status_code == 507, r.text
        assert client.app.state.service.fatal_error is None
        assert client.get("/v2/health/ready").status_code == 200
    # a stored set that cannot load is skipped at start, whatever its name
    (tmp_path / "launch_failed.safetensors").write_bytes(
        st_body({"w": torch.randn(4, 16, 16)}))
    app = create_app(settings, engine=Engine("cpu", warmup_rows=[1]))
    with TestClient(app) as client:
        _wait_ready(client)
        assert app.state.service.fatal_error is None
        assert "resident budget" in app.state.service.load_errors["launch_failed"]


def test_no_space_errors() -> None:
    assert is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert is_no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_no_space(OSError(errno.EACCES, "Permission denied"))
    assert not is_no_space(ValueError("no space"))


# ------------------------------------------------------------------------------ in-process


class PoisonEngine(Engine):
    """Raises the error a GPU's illegal memory access gives, on serving launches of "boom"."""

    def __init__(self) -> None:
        super().__init__("cpu", warmup_rows=[1])

    def grouped_mm_many(self, ws, requests, *, out_dtype=None):
        name = ws if isinstance(ws, str) else ws.name
        if name == "boom" and not getattr(self._tls, "warming", False):
            raise RuntimeError(ILLEGAL)
        return super().grouped_mm_many(ws, requests, out_dtype=out_dtype)


def _wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 30
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _mm(client: TestClient, name: str, x: torch.Tensor, counts: list[int]) -> httpx.Response:
    return client.post(f"/v1/weights/{name}/grouped-mm",
                       content=st_body({"x": x, "counts": torch.tensor(counts)}))


def test_sticky_error_makes_the_server_unready_and_asks_to_exit(tmp_path: Path) -> None:
    exits: list[str] = []
    app = create_app(Settings(data_dir=tmp_path), engine=PoisonEngine())
    app.state.service.on_fatal = exits.append
    w = torch.randn(2, 4, 3)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/fine", content=st_body({"w": w})).status_code == 201
        assert client.put("/v1/weights/boom", content=st_body({"w": w})).status_code == 201
        x = torch.randn(3, 4)
        assert _mm(client, "fine", x, [1, 2]).status_code == 200
        r = _mm(client, "boom", x, [1, 2])
        assert r.status_code == 503 and "device failed" in r.json()["error"]
        assert "illegal memory access" in r.json()["error"]
        assert exits == [f"RuntimeError: {ILLEGAL}"]
        ready = client.get("/v2/health/ready")
        assert ready.status_code == 503 and "restarting" in ready.json()["error"]
        assert client.get("/v2/health/live").status_code == 503
        # nothing else is served by a poisoned process, and on_fatal fired once
        assert _mm(client, "fine", x, [1, 2]).status_code == 503
        assert exits == [f"RuntimeError: {ILLEGAL}"]
    # the acknowledged sets are on disk for the next process
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "boom.safetensors", "fine.safetensors"]


_LAUNCHER = """
import sys
from moe_gemm_server.engine import Engine
_orig = Engine.grouped_mm_many
def _poisoned(self, ws, requests, *, out_dtype=None):
    name = ws if isinstance(ws, str) else ws.name
    if name == "boom" and not getattr(self._tls, "warming", False):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return _orig(self, ws, requests, out_dtype=out_dtype)
Engine.grouped_mm_many = _poisoned
from moe_gemm_server.cli import main
main(sys.argv[1:])
"""


def test_sticky_error_exits_70_and_a_restart_keeps_the_weight_sets(tmp_path: Path) -> None:
    """The real command line: the injected CUDA error ends the process with status 70; the
    next process (what a supervisor starts) serves every acknowledged set."""
    launcher = tmp_path / "poisoned_server.py"
    launcher.write_text(_LAUNCHER)
    data = tmp_path / "data"
    data.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GEMM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "server")])
    log_path = tmp_path / "poisoned.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(launcher), "--port", str(port), "--data-dir", str(data),
             "--warmup-rows", "1"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        ws = {name: torch.randn(3, 8, 5) for name in ("keep", "boom")}
        for name, w in ws.items():
            assert httpx.put(f"{url}/v1/weights/{name}", content=st_body({"w": w}),
                             timeout=30).status_code == 201
        x = torch.randn(6, 8)
        body = st_body({"x": x, "counts": torch.tensor([1, 2, 3])})
        r = httpx.post(f"{url}/v1/weights/boom/grouped-mm", content=body, timeout=30)
        assert r.status_code == 503 and "device failed" in r.json()["error"]
        assert proc.wait(timeout=60) == EXIT_DEVICE_FAILED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = log_path.read_text()
    assert "unrecoverable device error" in text and "exiting so the supervisor restarts" in text
    # the supervisor's restart: an ordinary server over the same data directory
    server = LiveServer(data, "--warmup-rows", "1")
    try:
        server.start()
        for name, w in ws.items():
            r = httpx.post(f"{server.url}/v1/weights/{name}/grouped-mm", content=body, timeout=30)
            assert r.status_code == 200, r.text
            y = st_load(r.content)["y"]
            assert torch.allclose(y.double(), mm_ref(x, w, torch.tensor([1, 2, 3])), atol=1e-4)
    finally:
        server.stop()


class OomOnUploadEngine(Engine):
    """Copying weights to the device runs out of memory past `limit` resident bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__("cpu", warmup_rows=[1])
        self.limit = limit

    def prepare_weights(self, name, tensor, layout="w", *, warm=True, scale=None):
        if self.resident_bytes + tensor.numel() * tensor.element_size() > self.limit:
            raise EngineOutOfMemory("out of memory on cuda:0: CUDA out of memory. Tried to "
                                    "allocate 64.00 MiB")
        return super().prepare_weights(name, tensor, layout, warm=warm, scale=scale)


def test_resident_budget_refuses_with_507_and_the_budget(tmp_path: Path) -> None:
    one = torch.randn(4, 16, 16)  # 4096 bytes in float32
    budget = 10_000
    app = create_app(Settings(data_dir=tmp_path, max_resident_bytes=budget),
                     engine=Engine("cpu", warmup_rows=[1]))
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/a", content=st_body({"w": one})).status_code == 201
        assert client.put("/v1/weights/b", content=st_body({"w": one})).status_code == 201
        r = client.put("/v1/weights/c", content=st_body({"w": one}))
        assert r.status_code == 507
        msg = r.json()["error"]
        assert "10000-byte resident budget" in msg and "needs 4096 bytes" in msg
        assert "--max-resident-bytes" in msg and "1808" in msg  # bytes still free
        assert not (tmp_path / "c.safetensors").exists()
        # replacing a set counts its old bytes as freed
        assert client.put("/v1/weights/a", content=st_body({"w": one * 2})).status_code == 200
        # the sets already there keep serving
        x = torch.randn(5, 16)
        y = st_load(_mm(client, "a", x, [1, 1, 1, 2]).content)["y"]
        assert torch.allclose(y.double(), mm_ref(x, one * 2, torch.tensor([1, 1, 1, 2])),
                              atol=1e-4)
        assert client.delete("/v1/weights/b").status_code == 200
        assert client.put("/v1/weights/c", content=st_body({"w": one})).status_code == 201
    # a restart with a smaller budget loads what fits and reports the rest, without crashing
    app2 = create_app(Settings(data_dir=tmp_path, max_resident_bytes=5000),
                      engine=Engine("cpu", warmup_rows=[1]))
    with TestClient(app2) as client:
        _wait_ready(client)
        names = [w["name"] for w in client.get("/v1/weights").json()["weights"]]
        assert names == ["a"]
        assert "resident budget" in app2.state.service.load_errors["c"]


def test_device_out_of_memory_on_upload_is_507(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path), engine=OomOnUploadEngine(limit=6000))
    with TestClient(app) as client:
        _wait_ready(client)
        w = torch.randn(4, 16, 16)
        assert client.put("/v1/weights/a", content=st_body({"w": w})).status_code == 201
        r = client.put("/v1/weights/b", content=st_body({"w": w}))
        assert r.status_code == 507
        assert "does not fit in device memory" in r.json()["error"]
        assert "4096 bytes held by 1 resident set" in r.json()["error"]
        assert client.get("/v2/health/ready").status_code == 200  # not a crash


def test_host_out_of_memory_on_the_cpu_engine_is_503_and_507_not_500(tmp_path: Path) -> None:
    """Real allocations the host cannot make, on the CPU engine: a warm-up at a row count
    configured far too high (an upload: 507, as a set that does not fit in device memory) and
    an ad-hoc problem with K = 0 and a 512 TiB result (a matmul: 503, as a GPU's
    out-of-memory). torch's CPU allocator raises a plain RuntimeError, which answered 500."""
    rows = 10**9  # warm-up input: 10^9 x 1024 float32 = 4 TB
    settings = Settings(data_dir=tmp_path, max_rows=rows, warmup_rows=[rows],
                        max_output_bytes=1 << 60)
    app = create_app(settings, engine=Engine("cpu", warmup_rows=[rows], max_rows=rows))
    with TestClient(app) as client:
        _wait_ready(client)
        r = client.put("/v1/weights/a", content=st_body({"w": torch.randn(2, 1024, 4)}))
        assert r.status_code == 507, r.text
        assert "does not fit in device memory" in r.json()["error"]
        assert "out of host memory" in r.json()["error"]
        huge = {"a.0": torch.empty(65536, 0), "b.0": torch.empty(0, 2**31 - 1)}
        r = client.post("/v1/grouped-gemm", content=st_body(huge))
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1" and "out of host memory" in r.json()["error"]
        text = client.get("/metrics").text
        assert metric(text, "moe_gemm_rejections_total", reason="out_of_memory") == 2
        # the engine carries on
        a, b = torch.randn(3, 5), torch.randn(5, 2)
        r = client.post("/v1/grouped-gemm", content=st_body({"a.0": a, "b.0": b}))
        assert r.status_code == 200
        assert torch.allclose(st_load(r.content)["d.0"], a @ b, atol=1e-5)
        assert not (tmp_path / "a.safetensors").exists()
        assert not (tmp_path / "b.safetensors").exists()


class _FullDisk(io.RawIOBase):
    """A file whose writes fail with ENOSPC once `room` bytes are written."""

    def __init__(self, path: str, room: int) -> None:
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.room = room

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[no-untyped-def]
        data = bytes(b)
        if len(data) > self.room:
            self._f.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self._f.write(data)

    def flush(self) -> None:
        if not self._f.closed:
            self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        super().close()
        self._f.close()


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_disk_full_during_upload_keeps_the_previous_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    app = create_app(Settings(data_dir=tmp_path), engine=Engine("cpu", warmup_rows=[1]))
    v1, v2 = torch.randn(2, 64, 32), torch.randn(2, 64, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/w", content=st_body({"w": v1})).status_code == 201
        on_disk = (tmp_path / "w.safetensors").read_bytes()
        if where == "write":  # the disk fills half-way through the body
            monkeypatch.setattr(service_mod, "open",
                                lambda p, mode="r": _FullDisk(p, 4096), raising=False)
        else:  # the data fits in the page cache; the flush to disk at commit fails
            def fsync(fd: int) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(storage_mod.os, "fsync", fsync)
        r = client.put("/v1/weights/w", content=st_body({"w": v2}))
        monkeypatch.undo()
        assert r.status_code == 507, r.text
        assert "is full" in r.json()["error"] and "previous version" in r.json()["error"]
        # the previous version: on disk byte for byte, in memory, and no temp file left
        assert (tmp_path / "w.safetensors").read_bytes() == on_disk
        assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
        x = torch.randn(4, 64)
        y = st_load(_mm(client, "w", x, [2, 2]).content)["y"]
        assert torch.allclose(y.double(), mm_ref(x, v1, torch.tensor([2, 2])), atol=1e-4)
        # and the service carries on: the next upload (space freed) works
        assert client.put("/v1/weights/w", content=st_body({"w": v2})).status_code == 200


def _flush_fails_once(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The next flush of the data directory (fsync of the directory, right after a commit's
    rename) fails with EIO; the ones after it work. Returns the flushed paths."""
    real = storage_mod._fsync_dir
    seen: list[Path] = []

    def flush(path: Path) -> None:
        seen.append(path)
        if len(seen) == 1:
            raise OSError(errno.EIO, "Input/output error")
        real(path)
    monkeypatch.setattr(storage_mod, "_fsync_dir", flush)
    return seen


def test_a_failed_directory_flush_leaves_the_set_not_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upload's file was renamed into place, then the directory's flush failed: the 507
    says the set was not stored and its previous version is unchanged. That used to be untrue:
    the renamed file stayed under the name, and the next rescan (here or on another replica)
    or a restart served the upload that was refused. Now the rename is undone."""
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0),
                     engine=Engine("cpu", warmup_rows=[1]))
    service = app.state.service
    v1, v2 = torch.randn(2, 64, 32), torch.randn(2, 64, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/w", content=st_body({"w": v1})).status_code == 201
        on_disk = (tmp_path / "w.safetensors").read_bytes()
        fid = service.watcher.file_id("w")
        for name, body in (("w", v2), ("new", v1)):
            _flush_fails_once(monkeypatch)
            r = client.put(f"/v1/weights/{name}", content=st_body({"w": body}))
            monkeypatch.undo()
            assert r.status_code == 507, r.text
            msg = r.json()["error"]
            assert "Input/output error" in msg and "was not stored" in msg, msg
        # not stored: the previous version under its name (the same file), no other file left
        assert (tmp_path / "w.safetensors").read_bytes() == on_disk
        assert service.watcher.file_id("w") == fid
        assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
        assert client.portal.call(service.watcher.rescan) == 0
        assert [s["name"] for s in client.get("/v1/weights").json()["weights"]] == ["w"]
        x = torch.randn(4, 64)
        y = st_load(_mm(client, "w", x, [2, 2]).content)["y"]
        assert torch.allclose(y.double(), mm_ref(x, v1, torch.tensor([2, 2])), atol=1e-4)
    # a restart serves the previous version too
    app2 = create_app(Settings(data_dir=tmp_path), engine=Engine("cpu", warmup_rows=[1]))
    with TestClient(app2) as client:
        _wait_ready(client)
        assert [s["name"] for s in client.get("/v1/weights").json()["weights"]] == ["w"]
        y = st_load(_mm(client, "w", x, [2, 2]).content)["y"]
        assert torch.allclose(y.double(), mm_ref(x, v1, torch.tensor([2, 2])), atol=1e-4)


def test_a_failed_directory_flush_leaves_the_set_not_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DELETE unlinked the set's file, then the directory's flush failed: the 507 says it was
    not deleted, and it is not: the file is back under its name (it used to stay gone, so
    the other replicas dropped the set at their next rescan and this one at a restart while
    it went on serving it here)."""
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0),
                     engine=Engine("cpu", warmup_rows=[1]))
    service = app.state.service
    v1 = torch.randn(2, 64, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/w", content=st_body({"w": v1})).status_code == 201
        on_disk = (tmp_path / "w.safetensors").read_bytes()
        _flush_fails_once(monkeypatch)
        r = client.delete("/v1/weights/w")
        monkeypatch.undo()
        assert r.status_code == 507, r.text
        msg = r.json()["error"]
        assert "Input/output error" in msg and "was not deleted" in msg, msg
        assert (tmp_path / "w.safetensors").read_bytes() == on_disk
        assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no link left
        assert client.portal.call(service.watcher.rescan) == 0
        x = torch.randn(4, 64)
        y = st_load(_mm(client, "w", x, [2, 2]).content)["y"]
        assert torch.allclose(y.double(), mm_ref(x, v1, torch.tensor([2, 2])), atol=1e-4)
        # and a DELETE that goes through removes it for good
        assert client.delete("/v1/weights/w").status_code in (200, 204)
        assert list(tmp_path.iterdir()) == []
    app2 = create_app(Settings(data_dir=tmp_path), engine=Engine("cpu", warmup_rows=[1]))
    with TestClient(app2) as client:
        _wait_ready(client)
        assert client.get("/v1/weights").json()["weights"] == []


def test_a_failed_flush_that_cannot_be_undone_says_the_change_is_in_doubt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a filesystem without hard links the previous file cannot be kept, so a failed
    directory flush cannot be undone: the 507 must not claim "not stored" / "not deleted"
    (the change is in place, only not known to be on disk) but say it may or may not be."""
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0),
                     engine=Engine("cpu", warmup_rows=[1]))
    v1, v2 = torch.randn(2, 64, 32), torch.randn(2, 64, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/w", content=st_body({"w": v1})).status_code == 201
        for method, body, words in (("put", st_body({"w": v2}), "may be stored or not"),
                                    ("delete", None, "may be deleted or not")):
            _flush_fails_once(monkeypatch)
            monkeypatch.setattr(storage_mod.os, "link", _no_links)
            r = (client.put("/v1/weights/w", content=body) if body is not None
                 else client.delete("/v1/weights/w"))
            monkeypatch.undo()
            assert r.status_code == 507, r.text
            msg = r.json()["error"]
            assert words in msg and "Input/output error" in msg and "not stored" not in msg, msg
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        assert not (tmp_path / "w.safetensors").exists()  # the delete did happen


def _no_links(src: object, dst: object, **kwargs: object) -> None:
    raise OSError(errno.EPERM, "Operation not permitted")


def test_read_only_data_dir_is_a_clear_507_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data directory that turned read-only (or lost its permissions) is 507 naming it,
    for an upload and a delete alike, not a 500 "server bug"; the sets stay served."""
    app = create_app(Settings(data_dir=tmp_path), engine=Engine("cpu", warmup_rows=[1]))
    v1 = torch.randn(2, 64, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/w", content=st_body({"w": v1})).status_code == 201

        def read_only(*args: object, **kwargs: object) -> None:
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(storage_mod.os, "replace", read_only)
        r = client.put("/v1/weights/w", content=st_body({"w": torch.randn(2, 64, 32)}))
        monkeypatch.undo()
        assert r.status_code == 507, r.text
        assert "cannot be written (Read-only file system)" in r.json()["error"]
        assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
        monkeypatch.setattr(storage_mod.Path, "unlink", read_only)
        r = client.delete("/v1/weights/w")
        assert r.status_code == 507, r.text
        assert "cannot be written" in r.json()["error"] and "not deleted" in r.json()["error"]
        monkeypatch.undo()
        # counted like every other refusal (they were not counted at all)
        assert metric(client.get("/metrics").text, "moe_gemm_rejections_total",
                      reason="not_writable") == 2
        x = torch.randn(4, 64)
        y = st_load(_mm(client, "w", x, [2, 2]).content)["y"]
        assert torch.allclose(y.double(), mm_ref(x, v1, torch.tensor([2, 2])), atol=1e-4)


def test_a_file_size_limit_is_a_counted_507_and_changes_nothing(tmp_path: Path) -> None:
    """A real file-size limit (RLIMIT_FSIZE, set on the running server): the upload's write
    fails with EFBIG. It is a 507 saying so, the previous version stays served, and it is
    counted under no_space (it was counted nowhere)."""
    import resource

    server = LiveServer(tmp_path / "data", "--warmup-rows", "1")
    try:
        server.start()
        url = server.url
        v1 = torch.randn(2, 64, 32)
        assert httpx.put(f"{url}/v1/weights/w", content=st_body({"w": v1}),
                         timeout=30).status_code == 201
        on_disk = (tmp_path / "data" / "w.safetensors").read_bytes()
        limit = 1 << 20  # (the server's log, written by it too, stays far below)
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
        big = torch.randn(2, 1024, 256)  # 2 MiB
        r = httpx.put(f"{url}/v1/weights/w", content=st_body({"w": big}), timeout=30)
        assert r.status_code == 507, r.text
        assert "cannot hold a file this large (File too large" in r.json()["error"]
        assert "previous version" in r.json()["error"]
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric(text, "moe_gemm_rejections_total", reason="no_space") == 1
        assert (tmp_path / "data" / "w.safetensors").read_bytes() == on_disk
        assert [p.name for p in (tmp_path / "data").iterdir()] == ["w.safetensors"]
        x = torch.randn(4, 64)
        r = httpx.post(f"{url}/v1/weights/w/grouped-mm", timeout=30,
                       content=st_body({"x": x, "counts": torch.tensor([2, 2])}))
        assert torch.allclose(st_load(r.content)["y"].double(),
                              mm_ref(x, v1, torch.tensor([2, 2])), atol=1e-4)
    finally:
        server.stop()


def test_a_server_starting_on_a_shared_dir_keeps_uploads_in_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another server starting on the shared data directory (a replica restarted after a
    crash) removes crashed uploads' temp files, not the one of an upload still running."""
    app = create_app(Settings(data_dir=tmp_path), engine=Engine("cpu", warmup_rows=[1]))
    (tmp_path / ".upload-crashed.tmp").write_bytes(b"half")
    removed: list[int] = []
    real = service_mod.read_weight_file

    def replica_starts(path: Path, check_values: bool = False):  # type: ignore[no-untyped-def]
        removed.append(storage_mod.WeightStore(tmp_path).cleanup_temp())
        return real(path, check_values)
    with TestClient(app) as client:
        _wait_ready(client)
        (tmp_path / ".upload-crashed.tmp").write_bytes(b"half")
        monkeypatch.setattr(service_mod, "read_weight_file", replica_starts)
        v1 = torch.randn(2, 64, 32)
        r = client.put("/v1/weights/w", content=st_body({"w": v1}))
        monkeypatch.undo()
        assert r.status_code == 201, r.text
        assert removed == [1]
        assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
        x = torch.randn(4, 64)
        y = st_load(_mm(client, "w", x, [2, 2]).content)["y"]
        assert torch.allclose(y.double(), mm_ref(x, v1, torch.tensor([2, 2])), atol=1e-4)


def test_concurrent_puts_of_one_name_end_with_one_complete_set(main_server, admin) -> None:
    """Eight uploads of different tensors to one name at once: each is acknowledged, exactly
    one created it, and memory and disk hold the same one of them, whole."""
    name = "contended"
    versions = [torch.full((2, 32, 16), float(i + 1)) + torch.randn(2, 32, 16) * 0.01
                for i in range(8)]
    bodies = [st_body({"w": v}) for v in versions]
    statuses: dict[int, int] = {}
    barrier = threading.Barrier(len(bodies))

    def put(i: int) -> None:
        with httpx.Client(base_url=main_server.url, timeout=60,
                          headers=dict(admin.headers)) as c:
            barrier.wait()
            statuses[i] = c.put(f"/v1/weights/{name}", content=bodies[i]).status_code

    threads = [threading.Thread(target=put, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(statuses.values()) == [200] * 7 + [201], statuses
    x = torch.randn(3, 32)
    r = admin.post(f"/v1/weights/{name}/grouped-mm",
                   content=st_body({"x": x, "counts": torch.tensor([1, 2])}))
    assert r.status_code == 200, r.text
    y = st_load(r.content)["y"].double()
    served = [i for i, v in enumerate(versions)
              if torch.allclose(y, mm_ref(x, v, torch.tensor([1, 2])), atol=1e-3)]
    assert len(served) == 1, served
    stored = st_load((main_server.data_dir / f"{name}.safetensors").read_bytes())["w"]
    assert torch.equal(stored, versions[served[0]])
    assert not list(main_server.data_dir.glob(".upload-*"))
    assert admin.delete(f"/v1/weights/{name}").status_code == 200
