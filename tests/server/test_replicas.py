"""Two server processes over one data directory (replicas on a shared volume): an upload,
a replacement or a delete through either one is served by the other within the rescan interval."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from server_testutils import LiveServer, mm_ref, st_body, st_load

ADMIN = "replica-admin-key"
INTERVAL = "0.2"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer]]:
    data = tmp_path_factory.mktemp("replicas") / "data"
    a = LiveServer(data, "--admin-key", ADMIN, "--sync-interval-s", INTERVAL,
                   "--warmup-rows", "1")
    b = LiveServer(data, "--admin-key", ADMIN, "--sync-interval-s", INTERVAL,
                   "--warmup-rows", "1")
    try:
        a.start(wait=False)
        b.start()
        a.wait_ready()
        yield a, b
    finally:
        a.stop()
        b.stop()


def _client(server: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30,
                        headers={"Authorization": f"Bearer {ADMIN}"})


def _until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def _served(c: httpx.Client, name: str, w: torch.Tensor) -> bool:
    x = torch.ones(4, w.shape[1])
    counts = torch.tensor([4] + [0] * (w.shape[0] - 1))
    r = c.post(f"/v1/weights/{name}/grouped-mm", content=st_body({"x": x, "counts": counts}))
    if r.status_code != 200:
        return False
    return torch.allclose(st_load(r.content)["y"].double(), mm_ref(x, w, counts), atol=1e-4)


def test_upload_through_one_is_served_by_the_other(replicas) -> None:
    a, b = replicas
    w1, w2 = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    with _client(a) as ca, _client(b) as cb:
        assert cb.get("/v1/weights/shared").status_code == 404
        assert ca.put("/v1/weights/shared", content=st_body({"w": w1})).status_code == 201
        _until(lambda: _served(cb, "shared", w1), "b serves a's upload")
        # a replacement through b reaches a
        assert cb.put("/v1/weights/shared", content=st_body({"w": w2})).status_code == 200
        _until(lambda: _served(ca, "shared", w2), "a serves b's replacement")
        assert _served(cb, "shared", w2)
        # a delete through a reaches b
        assert ca.delete("/v1/weights/shared").status_code == 200
        _until(lambda: cb.get("/v1/weights/shared").status_code == 404, "b drops the set")


def test_a_bad_file_from_elsewhere_is_reported_not_fatal(replicas) -> None:
    a, b = replicas
    bad = b.data_dir / "broken.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    try:
        _until(lambda: "could not load weight set 'broken'" in b.log(), "b reports the file")
        with _client(b) as cb:
            assert cb.get("/v2/health/ready").status_code == 200
            # stored, not unknown: 503 saying why it is not served (it was a 404)
            r = cb.get("/v1/weights/broken")
            assert r.status_code == 503 and "could not be loaded" in r.json()["error"]
            w = torch.randn(1, 8, 8)
            assert cb.put("/v1/weights/after-bad", content=st_body({"w": w})).status_code == 201
            with _client(a) as ca:
                _until(lambda: _served(ca, "after-bad", w), "a still syncs")
        # reported once per file version, not at every rescan
        time.sleep(1.0)
        assert b.log().count("could not load weight set 'broken'") == 1
    finally:
        bad.unlink()


def test_a_replica_started_later_loads_everything(replicas, tmp_path: Path) -> None:
    a, _ = replicas
    w = torch.randn(3, 8, 4)
    with _client(a) as ca:
        assert ca.put("/v1/weights/late", content=st_body({"w": w})).status_code in (200, 201)
    c = LiveServer(a.data_dir, "--admin-key", ADMIN, "--warmup-rows", "1",
                   log_dir=tmp_path)
    try:
        c.start()
        with _client(c) as cc:
            assert _served(cc, "late", w)
    finally:
        c.stop()


def test_concurrent_uploads_through_both_converge_on_the_file_on_disk(replicas) -> None:
    """Both replicas PUT one name at once: whichever rename lands last is on disk, and within
    a few intervals both replicas serve exactly that file (a replica that recorded the other's
    file identity beside its own data used to serve its own upload forever)."""
    a, b = replicas
    E, K, N = 2, 8, 4
    path = a.data_dir / "race.safetensors"
    with _client(a) as ca, _client(b) as cb:
        for trial in range(6):
            wa, wb = torch.full((E, K, N), float(trial)), torch.full((E, K, N), 100.0 + trial)
            bodies = {ca: st_body({"w": wa}), cb: st_body({"w": wb})}
            statuses: list[int] = []

            def put(c: httpx.Client) -> None:
                statuses.append(c.put("/v1/weights/race", content=bodies[c]).status_code)

            threads = [threading.Thread(target=put, args=(c,)) for c in (ca, cb)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert len(statuses) == 2 and set(statuses) <= {200, 201}, statuses
            on_disk = load_file(path)["w"]
            assert torch.equal(on_disk, wa) or torch.equal(on_disk, wb)
            _until(lambda: _served(ca, "race", on_disk) and _served(cb, "race", on_disk),
                   f"trial {trial}: both replicas serve the file on disk", timeout=5.0)
