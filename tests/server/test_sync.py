"""The rescan of a shared data directory (sync.StoreWatcher), in-process: a volume unmounted
from under the data directory is not every set deleted, and a set another server wrote holds
its bytes in the resident budget while it loads."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from server_testutils import GatedEngine, metric, served, st_body, wait_event

from moe_gemm_server import Settings, create_app
from moe_gemm_server import service_weights as service_mod
from moe_gemm_server.engine import Engine, EngineOutOfMemory
from moe_gemm_server.storage import WeightStore
from moe_gemm_server.sync import StoreWatcher

UNMOUNTED = "taken for its volume unmounted"


def _wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 30
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _passes(watcher: StoreWatcher) -> Callable[[int], None]:
    def wait(n: int) -> None:
        target = watcher.rescans + n
        deadline = time.monotonic() + 10
        while watcher.rescans < target:
            assert time.monotonic() < deadline, "the data directory was not rescanned"
            time.sleep(0.01)
    return wait


def _syncing_app(data: Path) -> tuple[FastAPI, Callable[[int], None]]:
    """A CPU server on `data` that rescans it every 20 ms, and a wait for n more rescans."""
    app = create_app(Settings(data_dir=data, sync_interval_s=0.02),
                     engine=Engine("cpu", warmup_rows=[1]))
    return app, _passes(app.state.service.watcher)


def _listed(client: TestClient) -> list[str]:
    return [s["name"] for s in client.get("/v1/weights").json()["weights"]]


def _unmount_warnings(caplog: pytest.LogCaptureFixture) -> int:
    return sum(UNMOUNTED in r.getMessage() for r in caplog.records)


def _after_a_listing(monkeypatch: pytest.MonkeyPatch, store, action) -> threading.Event:
    """Run `action` once, right after a rescan's first listing that names a set (between the
    listing and the per-file stats); the event is set when it has run."""
    real_names = store.names
    done = threading.Event()

    def names_then_act() -> list[str]:
        out = real_names()
        if not done.is_set() and out:
            action()
            done.set()
        return out

    monkeypatch.setattr(store, "names", names_then_act)
    return done


# ------------------------------------------------------------------------------ unmounts


def test_an_empty_mountpoint_keeps_the_resident_sets(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The volume goes away and the path names an empty directory (here: the volume's
    directory renamed away, an empty one put in its place, another inode; an unmount also
    changes the filesystem). The rescan used to list it, read every set as deleted and drop
    them all, 404 for every request while ready said 200. Now the sets stay served, one
    warning says why, uploads and deletes are refused (they would land in the wrong place),
    and once the volume is back a delete on disk is seen again."""
    caplog.set_level(logging.INFO, logger="moe_gemm_server")
    data, volume = tmp_path / "data", tmp_path / "volume"
    app, passes = _syncing_app(data)
    wa, wb = torch.randn(2, 16, 8), torch.randn(3, 16, 8)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/a", content=st_body({"w": wa})).status_code == 201
        assert client.put("/v1/weights/b", content=st_body({"w": wb})).status_code == 201
        data.rename(volume)
        data.mkdir()  # the mountpoint left behind
        passes(5)
        assert _listed(client) == ["a", "b"]
        assert served(client, "a", wa) and served(client, "b", wb)
        assert client.get("/v2/health/ready").status_code == 200
        assert _unmount_warnings(caplog) == 1  # once, not at every pass
        r = client.put("/v1/weights/c", content=st_body({"w": wa}))
        assert r.status_code == 507, r.text
        assert "not the directory the resident weight sets were loaded from" in r.json()["error"]
        r = client.delete("/v1/weights/a")
        assert r.status_code == 507, r.text
        assert "not deleted" in r.json()["error"]
        assert list(data.iterdir()) == []  # nothing written to the wrong filesystem
        assert _listed(client) == ["a", "b"]
        # the volume is back: syncing resumes, and a delete there is a delete
        data.rmdir()
        volume.rename(data)
        passes(3)
        assert not app.state.service.watcher.away
        assert any("is back" in r.getMessage() for r in caplog.records)
        (data / "a.safetensors").unlink()
        passes(3)
        assert _listed(client) == ["b"]
        assert client.put("/v1/weights/c", content=st_body({"w": wa})).status_code == 201
        assert _unmount_warnings(caplog) == 1


def test_every_set_deleted_from_the_directory_itself_is_dropped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another server deleting every set leaves the same directory empty: that is deletes,
    every set is dropped, no unmount is reported, and uploads carry on."""
    caplog.set_level(logging.INFO, logger="moe_gemm_server")
    app, passes = _syncing_app(tmp_path)
    w = torch.randn(2, 16, 8)
    with TestClient(app) as client:
        _wait_ready(client)
        for name in ("a", "b"):
            assert client.put(f"/v1/weights/{name}", content=st_body({"w": w})).status_code == 201
        for name in ("a", "b"):
            (tmp_path / f"{name}.safetensors").unlink()  # (as another server's DELETE does)
        passes(3)
        assert _listed(client) == []
        assert client.get("/v1/weights/a").status_code == 404
        assert _unmount_warnings(caplog) == 0
        assert client.put("/v1/weights/c", content=st_body({"w": w})).status_code == 201


def test_a_volume_unmounted_during_a_pass_keeps_the_resident_sets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The volume goes away after a pass listed it: its files' stats fail, and the listing
    taken after them (of the empty mountpoint) lacks them too. Only the directory's identity,
    taken before the first listing and after the second, tells that the second listing is of
    another directory."""
    data, volume = tmp_path / "data", tmp_path / "volume"
    app, passes = _syncing_app(data)

    def unmount() -> None:
        data.rename(volume)
        data.mkdir()

    w = torch.randn(2, 16, 8)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/w", content=st_body({"w": w})).status_code == 201
        gone = _after_a_listing(monkeypatch, app.state.service.store, unmount)
        wait_event(gone, "the data directory was not rescanned")
        passes(3)
        assert _listed(client) == ["w"] and served(client, "w", w)


def _other_filesystem(tmp_path: Path) -> Path:
    """A directory on another filesystem than tmp_path (/dev/shm is a tmpfs), else a skip."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    other = Path(tempfile.mkdtemp(dir=shm, prefix="moe-gemm-test-"))
    if os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        shutil.rmtree(other)
        pytest.skip("/dev/shm is on the same filesystem as the test's directory")
    return other


def _point(link: Path, target: Path) -> None:
    """Retarget the symlink `link` to `target` atomically (as a mount changes what a path
    names, all at once)."""
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def test_a_volume_remounted_with_another_filesystem_id_resumes_syncing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The data directory's path turns to an empty directory of another filesystem (another
    st_dev: an unmount): the sets are kept. Then to the volume again under yet another st_dev
    (a remount, as NFS may number it anew), with the resident sets in it: that is the
    volume, syncing resumes from there and a delete there is seen."""
    caplog.set_level(logging.INFO, logger="moe_gemm_server")
    other = _other_filesystem(tmp_path)
    try:
        volume, data = tmp_path / "volume", tmp_path / "data"
        volume.mkdir()
        data.symlink_to(volume)
        app, passes = _syncing_app(data)
        wa, wb = torch.randn(2, 16, 8), torch.randn(3, 16, 8)
        with TestClient(app) as client:
            _wait_ready(client)
            assert client.put("/v1/weights/a", content=st_body({"w": wa})).status_code == 201
            assert client.put("/v1/weights/b", content=st_body({"w": wb})).status_code == 201
            (other / "empty").mkdir()
            _point(data, other / "empty")  # unmounted: the parent filesystem's mountpoint
            passes(4)
            assert _listed(client) == ["a", "b"] and served(client, "a", wa)
            assert _unmount_warnings(caplog) == 1
            shutil.copytree(volume, other / "remounted")
            _point(data, other / "remounted")  # the volume again, another st_dev
            passes(3)
            assert not app.state.service.watcher.away
            assert app.state.service.watcher.home == app.state.service.store.dir_id()
            (other / "remounted" / "b.safetensors").unlink()
            passes(3)
            assert _listed(client) == ["a"] and served(client, "a", wa)
            assert client.put("/v1/weights/c", content=st_body({"w": wb})).status_code == 201
            assert (other / "remounted" / "c.safetensors").exists()
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_an_upload_whose_volume_goes_while_it_warms_is_not_acknowledged(
        tmp_path: Path) -> None:
    """The volume goes away after an upload passed its check of the data directory: its temp
    file is on the volume, so the commit's rename of it fails (507, nothing acknowledged);
    nothing is stored on the filesystem under the mountpoint either."""
    data, volume = tmp_path / "data", tmp_path / "volume"
    engine = GatedEngine("late")
    app = create_app(Settings(data_dir=data, sync_interval_s=0), engine=engine)
    w = torch.randn(2, 16, 8)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/a", content=st_body({"w": w})).status_code == 201
        answers: list[tuple[int, str]] = []

        def put() -> None:
            r = client.put("/v1/weights/late", content=st_body({"w": w}))
            answers.append((r.status_code, r.text))
        upload = threading.Thread(target=put)
        upload.start()
        wait_event(engine.entered, "the upload did not start warming")
        data.rename(volume)
        data.mkdir()
        engine.release.set()
        upload.join(30)
        assert answers and answers[0][0] == 507, answers
        assert "was not stored" in answers[0][1]
        assert list(data.iterdir()) == []
        # (its temp file stays on the volume, as a crashed upload's: the next start removes it)
        assert sorted(p.name for p in volume.glob("*.safetensors")) == ["a.safetensors"]
        assert _listed(client) == ["a"]


# ------------------------------------------------------------------------------ the budget


ONE = 2 * 16 * 32 * 4  # bytes of one (2, 16, 32) float32 set
BUDGET = 2 * ONE + ONE // 2  # room for two sets, not three


def _budget_app(tmp_path: Path, gated: str):
    """A service under BUDGET whose engine holds the preparation of `gated` (GatedEngine)."""
    engine = GatedEngine(gated)
    return create_app(Settings(data_dir=tmp_path, sync_interval_s=0,
                               max_resident_bytes=BUDGET), engine=engine), engine


def test_a_set_loading_from_the_directory_holds_its_bytes_against_an_upload(
        tmp_path: Path) -> None:
    """Another server wrote "synced"; this one's rescan admitted it under the budget and is
    loading it when an upload of "uploaded" arrives. The upload must count "synced"'s bytes:
    it used not to, both passed their checks and both ended resident, over the budget."""
    app, engine = _budget_app(tmp_path, "synced")
    service = app.state.service
    w = torch.randn(2, 16, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/first", content=st_body({"w": w})).status_code == 201
        service.store.write("synced", st_body({"w": w * 2}))  # (as another replica does)
        rescan = client.portal.start_task_soon(service.watcher.rescan)
        wait_event(engine.entered, "the rescan did not start loading the set")
        r = client.put("/v1/weights/uploaded", content=st_body({"w": w * 3}))
        engine.release.set()
        assert rescan.result(30) == 1
        assert r.status_code == 507, r.text
        assert "resident budget" in r.json()["error"]
        assert service.engine.resident_bytes == 2 * ONE <= BUDGET
        assert _listed(client) == ["first", "synced"]
        assert served(client, "synced", w * 2)
        assert not (tmp_path / "uploaded.safetensors").exists()
        assert service._reserved_bytes == 0


def _upload_warming_while_another_server_writes(client: TestClient, engine: GatedEngine,
                                                w: torch.Tensor
                                                ) -> tuple[threading.Thread, list[int]]:
    """"first" stored; an upload of "uploaded" (3 w) held in its warm-up by `engine`, in a
    thread whose answer's status lands in the list; "synced" (2 w) then written to the data
    directory, as another server sharing it does. Returns the thread and the list."""
    service = client.app.state.service
    assert client.put("/v1/weights/first", content=st_body({"w": w})).status_code == 201
    statuses: list[int] = []
    upload = threading.Thread(target=lambda: statuses.append(client.put(
        "/v1/weights/uploaded", content=st_body({"w": w * 3})).status_code))
    upload.start()
    wait_event(engine.entered, "the upload did not start warming")
    service.store.write("synced", st_body({"w": w * 2}))
    return upload, statuses


def test_an_upload_in_flight_holds_its_bytes_against_a_set_loading_from_the_directory(
        tmp_path: Path) -> None:
    """The other order: an upload admitted under the budget is warming when the rescan finds
    a set another server wrote; the rescan counts the upload's bytes and leaves that set out
    (reported as a load error) rather than going over the budget."""
    app, engine = _budget_app(tmp_path, "uploaded")
    service = app.state.service
    w = torch.randn(2, 16, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        upload, statuses = _upload_warming_while_another_server_writes(client, engine, w)
        assert client.portal.call(service.watcher.rescan) == 0
        engine.release.set()
        upload.join(30)
        assert statuses == [201]
        assert "resident budget" in service.load_errors["synced"]
        assert service.engine.resident_bytes == 2 * ONE <= BUDGET
        assert _listed(client) == ["first", "uploaded"]
        assert service._reserved_bytes == 0


def test_a_put_of_the_set_loading_from_the_directory_is_not_refused_for_its_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's first PUT went through another replica, which stored the set; its retry
    after a timeout reaches this one while its rescan loads that same file, with room for one
    copy. The retry used to be refused 507 (the load's bytes counted beside its own); now it
    waits for the load, then stores the set itself (the load acknowledges nothing)."""
    engine = GatedEngine("w")
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0,
                              max_resident_bytes=ONE + ONE // 2), engine=engine)
    service = app.state.service
    w = torch.randn(2, 16, 32)
    body = st_body({"w": w})
    real_read = service_mod.read_weight_file

    def read_then_release(path, check_values=False):  # type: ignore[no-untyped-def]
        out = real_read(path, check_values)  # (the retry's body, read in full)
        engine.release.set()
        return out
    monkeypatch.setattr(service_mod, "read_weight_file", read_then_release)
    with TestClient(app) as client:
        _wait_ready(client)
        service.store.write("w", body)  # (the first attempt, through another replica)
        rescan = client.portal.start_task_soon(service.watcher.rescan)
        wait_event(engine.entered, "the rescan did not start loading the set")
        try:
            r = client.put("/v1/weights/w", content=body)
        finally:
            engine.release.set()
        assert rescan.result(30) == 1
        assert r.status_code == 200, r.text
        assert r.json()["bytes"] == ONE
        assert _listed(client) == ["w"] and served(client, "w", w)
        assert service.engine.resident_bytes == ONE and service._reserved_bytes == 0
        assert service.watcher.loaded["w"] == service.watcher.file_id("w")


class RefusedAfterWarmUp(GatedEngine):
    """GatedEngine whose held preparation then fails: an upload admitted under the budget,
    holding its bytes for a while, and refused in the end (422)."""

    def prepare_weights(self, name, tensor, layout="w", *, warm=True, scale=None):
        ws = super().prepare_weights(name, tensor, layout, warm=warm, scale=scale)
        if name == self.gated:
            raise ValueError("refused after its warm-up")
        return ws


def test_a_set_over_the_budget_only_for_a_moment_is_loaded_once_it_fits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rescan finds a set another server wrote while an upload here holds the bytes it
    would need; the upload then fails and frees them. The set used to stay left out (its file
    version was marked failed) until its file changed or the server restarted; now a later
    pass loads it. A pass while it still does not fit does not read its file again."""
    engine = RefusedAfterWarmUp("uploaded")
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0,
                              max_resident_bytes=BUDGET), engine=engine)
    service = app.state.service
    w = torch.randn(2, 16, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        upload, statuses = _upload_warming_while_another_server_writes(client, engine, w)
        reads: list[str] = []
        real_load = service.store.load
        monkeypatch.setattr(service.store, "load",
                            lambda name: reads.append(name) or real_load(name))
        assert client.portal.call(service.watcher.rescan) == 0
        assert "resident budget" in service.load_errors["synced"]
        assert client.portal.call(service.watcher.rescan) == 0  # still no room
        assert reads == ["synced"]  # (not read again while it cannot fit)
        engine.release.set()
        upload.join(30)
        assert statuses == [422]
        assert client.portal.call(service.watcher.rescan) == 1
        assert reads == ["synced", "synced"]
        assert _listed(client) == ["first", "synced"] and served(client, "synced", w * 2)
        assert "synced" not in service.load_errors
        assert service.engine.resident_bytes == 2 * ONE <= BUDGET
        assert service._reserved_bytes == 0
        assert client.portal.call(service.watcher.rescan) == 0


def _room_for_one(tmp_path: Path, sync_interval_s: float, *extra: tuple[str, bytes]):
    """Two stored sets "a" and "b" (b = 2a) and the `extra` files, an app whose budget holds
    one set: (a's weights, the app)."""
    w = torch.randn(2, 16, 32)
    store = WeightStore(tmp_path)
    store.write("a", st_body({"w": w}))
    store.write("b", st_body({"w": w * 2}))
    for name, body in extra:
        store.write(name, body)
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=sync_interval_s,
                              max_resident_bytes=ONE + ONE // 2),
                     engine=Engine("cpu", warmup_rows=[1]))
    return w, app


def test_a_set_over_the_budget_at_start_is_loaded_once_a_delete_frees_room(
        tmp_path: Path) -> None:
    """Two stored sets, room for one: the start loads one and leaves the other out. A delete
    through this server frees the room; the rescans then load the other (it used to be left
    out until a restart)."""
    w, app = _room_for_one(tmp_path, 0.02)
    passes = _passes(app.state.service.watcher)
    with TestClient(app) as client:
        _wait_ready(client)
        passes(2)
        assert _listed(client) == ["a"]
        assert "resident budget" in app.state.service.load_errors["b"]
        assert client.delete("/v1/weights/a").status_code == 200
        passes(3)
        assert _listed(client) == ["b"] and served(client, "b", w * 2)
        assert "b" not in app.state.service.load_errors


def test_a_data_dir_that_cannot_be_listed_keeps_the_resident_sets(tmp_path: Path) -> None:
    """The data directory gone for a while (a volume unmounted or moved, its permissions
    lost) says nothing about which sets were deleted: the rescan keeps serving them (it used
    to read the directory as empty and drop every set, 404 for all while ready said 200)."""
    data = tmp_path / "data"
    app, passes = _syncing_app(data)
    w = torch.randn(2, 64, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/w", content=st_body({"w": w})).status_code == 201
        data.rename(tmp_path / "elsewhere")
        passes(3)
        assert _listed(client) == ["w"] and served(client, "w", w)
        # back in place: the rescans carry on as before (a delete on disk is still seen)
        (tmp_path / "elsewhere").rename(data)
        (data / "w.safetensors").unlink()
        passes(3)
        assert _listed(client) == []


def test_a_data_dir_moved_between_listing_and_stat_keeps_the_resident_sets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory moved away after a rescan listed it but before it stat'ed the files: the
    files look deleted, but only a listing taken after the stat can say so (the pass used to
    drop every set here)."""
    data = tmp_path / "data"
    app, passes = _syncing_app(data)
    w = torch.randn(2, 64, 32)
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.put("/v1/weights/w", content=st_body({"w": w})).status_code == 201
        moved = _after_a_listing(monkeypatch, app.state.service.store,
                                 lambda: data.rename(tmp_path / "elsewhere"))
        wait_event(moved, "the data directory was not rescanned")
        passes(2)
        assert _listed(client) == ["w"] and served(client, "w", w)
        # a real delete, with the directory in place, is still seen
        (tmp_path / "elsewhere").rename(data)
        (data / "w.safetensors").unlink()
        passes(3)
        assert _listed(client) == []


# ------------------------------------------------------------------------ unreadable entries


def test_a_symlink_loop_in_the_data_dir_is_skipped_not_fatal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A `<name>.safetensors` that cannot be followed (a symlink loop: ELOOP) made the whole
    listing raise: a server starting on such a directory stayed not ready for good (liveness
    200, so nothing restarted it), and one that met it while running stopped syncing every
    set (a set deleted on disk still served, a new one never loaded), warning at every pass.
    It is skipped now, as a dangling symlink is, with one warning."""
    caplog.set_level(logging.INFO, logger="moe_gemm_server")
    data = tmp_path / "data"
    data.mkdir()
    wa, wb = torch.randn(2, 16, 8), torch.randn(3, 16, 8)
    (data / "a.safetensors").write_bytes(st_body({"w": wa}))
    (data / "loop.safetensors").symlink_to("loop.safetensors")
    app, passes = _syncing_app(data)
    with TestClient(app) as client:
        _wait_ready(client)  # (used to time out: "start-up failed (OSError: [Errno 40] ...")
        assert _listed(client) == ["a"]
        assert served(client, "a", wa)
        # while running: another loop appears, and the directory still syncs past it
        (data / "loop2.safetensors").symlink_to("loop2.safetensors")
        passes(2)
        (data / "b.safetensors").write_bytes(st_body({"w": wb}))
        (data / "a.safetensors").unlink()
        passes(3)
        assert _listed(client) == ["b"]
        assert served(client, "b", wb)
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 2, skipped  # once per entry, not at every pass
    assert not any("cannot list the data directory" in r.getMessage() for r in caplog.records)


def test_a_stored_set_left_out_is_507_or_503_never_404(tmp_path: Path) -> None:
    """A restart under a smaller budget leaves a stored set out. Every route naming it used
    to answer 404 "unknown weight set" (while a re-upload got 507 for the budget): it is 507
    now, saying that it does not fit and what loads it, and the listing names it under
    "not_loaded"; a stored file that cannot be read as a set is 503. Deleting the set makes it
    unknown (404); the load at start is no rejected request."""
    w, app = _room_for_one(tmp_path, 0, ("broken", b"not a safetensors file"))
    x = {"x": torch.randn(3, 16), "counts": torch.tensor([1, 2])}
    v2 = {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16},
                     {"name": "counts", "shape": [2], "datatype": "INT32", "data": [1, 0]}]}
    with TestClient(app) as client:
        _wait_ready(client)
        listing = client.get("/v1/weights").json()
        assert [s["name"] for s in listing["weights"]] == ["a"]
        assert [(s["name"], s["status"]) for s in listing["not_loaded"]] == [
            ("b", 507), ("broken", 503)]
        assert metric(client.get("/metrics").text, "moe_gemm_rejections_total",
                      reason="over_budget") == 0
        answers = [client.get("/v1/weights/b"),
                   client.post("/v1/weights/b/grouped-mm", content=st_body(x)),
                   client.get("/v2/models/b"), client.get("/v2/models/b/ready"),
                   client.get("/v2/models/b/config"), client.get("/v2/models/b/stats"),
                   client.post("/v2/models/b/infer", json=v2)]
        for r in answers:
            assert r.status_code == 507, (r.request.url, r.text)
            msg = r.json()["error"]
            assert "'b' is stored but not loaded, as it does not fit" in msg, msg
            assert "resident budget (--max-resident-bytes)" in msg and "restart" in msg
        assert metric(client.get("/metrics").text, "moe_gemm_rejections_total",
                      reason="over_budget") == len(answers)
        r = client.post("/v1/weights/broken/grouped-mm", content=st_body(x))
        assert r.status_code == 503 and r.json()["code"] == "weight_set_unreadable"
        assert client.get("/v2/models/broken/config").status_code == 503
        assert "'broken' is stored but its file could not be loaded" in r.json()["error"]
        assert "malformed safetensors" in r.json()["error"]
        assert client.put("/v1/weights/b", content=st_body({"w": w})).status_code == 507
        assert client.delete("/v1/weights/b").status_code == 200
        assert client.get("/v1/weights/b").status_code == 404
        assert client.delete("/v1/weights/broken").status_code == 200
        assert client.get("/v1/weights").json()["not_loaded"] == []
        assert client.get("/v2/models/broken").status_code == 404
        assert served(client, "a", w)


def test_a_set_left_out_at_start_is_served_once_a_rescan_loads_it(tmp_path: Path) -> None:
    """The 507 of a set left out for the budget lasts until a rescan loads it: then it is
    served and no longer listed as not loaded."""
    w, app = _room_for_one(tmp_path, 0.02)
    passes = _passes(app.state.service.watcher)
    with TestClient(app) as client:
        _wait_ready(client)
        r = client.get("/v1/weights/b")
        assert r.status_code == 507 and "every 0.02 s" in r.json()["error"]
        assert client.delete("/v1/weights/a").status_code == 200
        passes(3)
        assert client.get("/v1/weights/b").status_code == 200
        assert client.get("/v1/weights").json()["not_loaded"] == []
        assert served(client, "b", w * 2)


def test_a_file_that_fails_to_load_in_a_rescan_counts_as_a_load_error(tmp_path: Path) -> None:
    """moe_gemm_weight_load_errors_total counts rescans' failures too; its help text said
    "at start" only."""
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0),
                     engine=Engine("cpu", warmup_rows=[1]))
    service = app.state.service
    with TestClient(app) as client:
        _wait_ready(client)
        text = client.get("/metrics").text
        assert metric(text, "moe_gemm_weight_load_errors_total") == 0
        service.store.write("broken", b"not a safetensors file")  # (as another replica might)
        assert client.portal.call(service.watcher.rescan) == 0
        text = client.get("/metrics").text
        assert metric(text, "moe_gemm_weight_load_errors_total") == 1
        help_line = next(ln for ln in text.splitlines()
                         if ln.startswith("# HELP moe_gemm_weight_load_errors_total"))
        assert "at start or in a rescan of the data directory" in help_line


def test_a_resident_set_whose_new_file_fails_to_load_is_not_listed_as_not_loaded(
        tmp_path: Path) -> None:
    """Another server replaces a resident set's file with one that cannot be read: the
    resident version stays served (200), so the listing does not name the set under
    "not_loaded" with a 503 that no request for it is answered."""
    w = torch.randn(2, 16, 32)
    store = WeightStore(tmp_path)
    store.write("a", st_body({"w": w}))
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0),
                     engine=Engine("cpu", warmup_rows=[1]))
    service = app.state.service
    with TestClient(app) as client:
        _wait_ready(client)
        service.store.write("a", b"not a safetensors file")  # (as another replica might)
        assert client.portal.call(service.watcher.rescan) == 0
        assert client.get("/v1/weights/a").status_code == 200
        listing = client.get("/v1/weights").json()
        assert [s["name"] for s in listing["weights"]] == ["a"]
        assert listing["not_loaded"] == []
        assert served(client, "a", w)


def test_an_upload_over_a_stored_set_left_out_replaces_it(tmp_path: Path) -> None:
    """A stored set left out of memory is no unknown set (507 or 503, not 404): an upload of
    its name replaces it, 200, as the table of PUT answers says, not 201 "new"."""
    w = torch.randn(2, 16, 32)
    store = WeightStore(tmp_path)
    store.write("a", st_body({"w": w}))
    store.write("b", st_body({"w": w * 2}))
    store.write("broken", b"not a safetensors file")
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0,
                              max_resident_bytes=ONE + ONE // 2),
                     engine=Engine("cpu", warmup_rows=[1]))
    with TestClient(app) as client:
        _wait_ready(client)
        assert client.get("/v1/weights/b").status_code == 507
        assert client.get("/v1/weights/broken").status_code == 503
        assert client.delete("/v1/weights/a").status_code == 200
        assert client.put("/v1/weights/b", content=st_body({"w": w})).status_code == 200
        assert client.put("/v1/weights/broken", content=st_body({"w": w / 2})).status_code == 507
        assert client.delete("/v1/weights/b").status_code == 200
        assert client.put("/v1/weights/broken", content=st_body({"w": w / 2})).status_code == 200
        assert client.get("/v1/weights").json()["not_loaded"] == []
        assert served(client, "broken", w / 2)


# ------------------------------------------------------------------------- sets left out


class _OutOfMemoryFor(Engine):
    """A CPU engine that runs out of memory preparing the set `oom`, and says that `free` of
    its 1 GiB are free."""

    def __init__(self, oom: str) -> None:
        super().__init__("cpu", warmup_rows=[1])
        self.oom = oom
        self.free = 1000

    def prepare_weights(self, name, tensor, layout="w", *, warm=True, scale=None):
        if name == self.oom:
            raise EngineOutOfMemory("out of host memory: tried to allocate 8 GiB")
        return super().prepare_weights(name, tensor, layout, warm=warm, scale=scale)

    def free_memory(self) -> tuple[int, int]:
        return self.free, 1 << 30


SMALL = torch.randn(2, 4, 8)  # ONE // 16 bytes


def test_the_507_of_a_set_left_out_for_the_budget_quotes_the_budget_of_the_moment(
        tmp_path: Path) -> None:
    """The 507 of a stored set left out for the budget quoted the numbers of its load ("only
    F of the budget are free (R bytes held by S set(s))"): once other sets came or went, the
    answer said what was no longer true. The numbers are those of the moment it answers."""
    w, app = _room_for_one(tmp_path, 0)
    budget = ONE + ONE // 2
    with TestClient(app) as client:
        _wait_ready(client)
        msg = client.get("/v1/weights/b").json()["error"]
        assert f"needs {ONE} bytes but only {ONE // 2} of the {budget}-byte" in msg, msg
        assert f"({ONE} bytes held by 1 set(s)" in msg, msg
        assert client.put("/v1/weights/c", content=st_body({"w": SMALL})).status_code == 201
        r = client.get("/v1/weights/b")
        held = ONE + ONE // 16
        assert r.status_code == 507
        assert f"only {budget - held} of the {budget}-byte" in r.json()["error"], r.text
        assert f"({held} bytes held by 2 set(s)" in r.json()["error"], r.text
        # room made: the listing says so (the set is loaded by the next request for it)
        assert client.delete("/v1/weights/a").status_code == 200
        (entry,) = client.get("/v1/weights").json()["not_loaded"]
        assert (f"which were not free when it was loaded; now {budget - ONE // 16} of the "
                f"{budget}-byte") in entry["error"], entry
        assert served(client, "b", w * 2)


def test_the_507_of_a_set_left_out_of_device_memory_quotes_the_memory_of_the_moment(
        tmp_path: Path) -> None:
    """Likewise for a set whose load ran out of device memory: the answer gave the load's
    error alone. It gives what the device holds and has free when it answers, beside it."""
    w = torch.randn(2, 16, 32)
    store = WeightStore(tmp_path)
    store.write("a", st_body({"w": w}))
    store.write("big", st_body({"w": w}))
    engine = _OutOfMemoryFor("big")
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0), engine=engine)
    with TestClient(app) as client:
        _wait_ready(client)
        r = client.get("/v1/weights/big")
        assert r.status_code == 507
        msg = r.json()["error"]
        assert "its load ran out of memory (out of host memory: tried to allocate 8 GiB)" in msg
        assert f"now cpu: {ONE} bytes held by 1 resident set(s), 1000 of {1 << 30} bytes " \
               "free" in msg, msg
        engine.free = 5000
        assert client.put("/v1/weights/c", content=st_body({"w": SMALL})).status_code == 201
        msg = client.get("/v2/models/big").json()["error"]
        assert f"now cpu: {ONE + ONE // 16} bytes held by 2 resident set(s), 5000 of " \
               f"{1 << 30} bytes free" in msg, msg


def test_an_unreadable_stored_set_is_a_503_that_says_retrying_does_not_cure_it(
        tmp_path: Path) -> None:
    """A stored file that cannot be read as a set answered 503 with Retry-After, as the 503s
    that pass do (starting, draining, out of memory for one request): clients retried it, and
    their user got the error seconds late. It has no Retry-After now and a code that says
    which 503 it is; the 503s that pass keep their Retry-After and have no code."""
    store = WeightStore(tmp_path)
    store.write("broken", b"not a safetensors file")
    app = create_app(Settings(data_dir=tmp_path, sync_interval_s=0),
                     engine=Engine("cpu", warmup_rows=[1]))
    x = {"x": torch.randn(3, 16), "counts": torch.tensor([1, 2])}
    with TestClient(app) as client:
        _wait_ready(client)
        for r in (client.get("/v1/weights/broken"),
                  client.post("/v1/weights/broken/grouped-mm", content=st_body(x)),
                  client.get("/v2/models/broken"), client.get("/v2/models/broken/config")):
            assert r.status_code == 503, (r.request.url, r.text)
            assert r.json()["code"] == "weight_set_unreadable", r.text
            assert "Retry-After" not in r.headers
        (entry,) = client.get("/v1/weights").json()["not_loaded"]
        assert entry["status"] == 503
        assert client.portal.call(app.state.service.drain, 1.0) is True
        r = client.get("/v1/weights/broken")
        assert r.status_code == 503 and "draining" in r.json()["error"]
        assert r.headers["Retry-After"] == "1" and "code" not in r.json()


# ------------------------------------------------------------- a set another server wrote


def _two_servers(tmp_path: Path, engine: Engine | None = None) -> tuple[FastAPI, FastAPI]:
    """Two CPU servers on one data directory, neither rescanning it."""
    return tuple(create_app(Settings(data_dir=tmp_path, sync_interval_s=0),
                            engine=e or Engine("cpu", warmup_rows=[1]))
                 for e in (None, engine))


def test_a_set_another_server_just_wrote_is_served_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A set uploaded through one server answered 404 "unknown" on another sharing its data
    directory until that one's next rescan (every 2 s by default): a client reading what it
    has just written, through a load balancer, met a set that does not exist. A request for
    a name that is not resident now looks at that name's file (one stat, no listing: unknown
    names make no rescans) and loads a version it has not tried, then answers."""
    first, second = _two_servers(tmp_path)
    w = torch.randn(2, 16, 32)
    service = second.state.service
    listings: list[int] = []
    real_names = service.store.names
    with TestClient(first) as one, TestClient(second) as two:
        _wait_ready(one)
        _wait_ready(two)
        # (from now on: the start lists the directory once)
        monkeypatch.setattr(service.store, "names", lambda: listings.append(1) or real_names())
        assert two.get("/v1/weights/fresh").status_code == 404
        assert one.put("/v1/weights/fresh", content=st_body({"w": w})).status_code == 201
        assert served(two, "fresh", w)
        assert two.get("/v2/models/fresh").json()["inputs"][0]["shape"] == [-1, 16]
        assert one.put("/v1/weights/other", content=st_body({"w": w / 2})).status_code == 201
        assert two.get("/v1/weights/other").json()["n"] == 32
        assert _listed(two) == ["fresh", "other"]
        assert two.get("/v1/weights/never-written").status_code == 404
        assert service.watcher.rescans == 0 and listings == []


def test_a_file_another_server_wrote_is_read_once_however_many_ask(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests for a set another server wrote, arriving while it loads, wait for that one
    load; a version that failed to load is not read again by the requests that follow."""
    engine = GatedEngine("fresh")
    first, second = _two_servers(tmp_path, engine)
    watcher = second.state.service.watcher
    looked: list[str] = []  # (a request's look at the file comes before it loads or waits)
    real_file_id = watcher.file_id
    monkeypatch.setattr(watcher, "file_id", lambda name: looked.append(name) or
                        real_file_id(name))
    reads: list[str] = []
    real_load = second.state.service.store.load
    monkeypatch.setattr(second.state.service.store, "load",
                        lambda name: reads.append(name) or real_load(name))
    w = torch.randn(2, 16, 32)
    with TestClient(first) as one, TestClient(second) as two:
        _wait_ready(one)
        _wait_ready(two)
        assert one.put("/v1/weights/fresh", content=st_body({"w": w})).status_code == 201
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(two.get, "/v1/weights/fresh")]
            wait_event(engine.entered, "the set was not loaded")
            answers.append(pool.submit(two.get, "/v1/weights/fresh"))
            deadline = time.monotonic() + 10
            while len(looked) < 2:  # (the second request has come while the first loads)
                assert time.monotonic() < deadline, looked
                time.sleep(0.01)
            engine.release.set()
            assert [a.result().status_code for a in answers] == [200, 200]
        assert reads == ["fresh"]
        one.app.state.service.store.write("broken", b"not a safetensors file")
        for _ in range(3):
            assert two.get("/v1/weights/broken").status_code == 503
        assert reads == ["fresh", "broken"]
