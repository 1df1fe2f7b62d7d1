"""Ray Serve: two local replicas of the server behind Ray's proxy (CPU), answering the same
requests correctly, with a weight set uploaded through one replica served by both.

CI installs ray (server's `test` extra). Where it is missing the test is skipped, saying so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from server_testutils import REPO, free_port, mm_ref, st_body, st_load

pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install "
                    "'moe-gemm-server[ray]' (CI installs it through the server's test extra)")

ADMIN = "ray-admin-key"
pytestmark = pytest.mark.slow  # a local Ray cluster and two replicas: ~30 s on 2 cores


@pytest.fixture(scope="module")
def ray_replicas(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ray")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOE_GEMM_", "RAY_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "server"), str(REPO / "client")])
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    log_path = root / "ray.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moe_gemm_server.ray_serve", "--replicas", "2",
             "--num-cpus", "0.5", "--", "--port", str(port), "--data-dir", str(root / "data"),
             "--admin-key", ADMIN, "--warmup-rows", "1", "--sync-interval-s", "0.2",
             "--batch-delay-us", "1000"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-6000:]
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-6000:]
            time.sleep(0.2)
        # both replicas up and ready (the proxy answers as soon as one is)
        seen: set[str] = set()
        with ThreadPoolExecutor(4) as pool:
            while len(seen) < 2:
                assert time.monotonic() < deadline, (seen, log_path.read_text()[-6000:])
                for r in pool.map(lambda _: httpx.get(f"{url}/v2/health/ready", timeout=10),
                                  range(8)):
                    if r.status_code == 200:
                        seen.add(r.headers["x-replica"])
        yield url, proc, log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the driver shuts Serve and its Ray down
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the processes this test started (its own session)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_two_replicas_answer_the_same_requests_correctly(ray_replicas) -> None:
    url, proc, log_path = ray_replicas
    w = torch.randn(4, 32, 16)
    auth = {"Authorization": f"Bearer {ADMIN}"}
    # one upload, through whichever replica the proxy picks
    r = httpx.put(f"{url}/v1/weights/experts", content=st_body({"w": w}), headers=auth,
                  timeout=60)
    assert r.status_code == 201, r.text
    uploaded_by = r.headers["x-replica"]
    gen = torch.Generator().manual_seed(0)
    cases = []
    for i in range(48):
        T = 1 + i % 9
        x = torch.randn(T, 32, generator=gen)
        counts = torch.bincount(torch.randint(0, 4, (T,), generator=gen), minlength=4)
        cases.append((x, counts))

    def send(case: tuple[torch.Tensor, torch.Tensor]) -> tuple[str, bool, int]:
        x, counts = case
        for _ in range(200):  # the other replica may not have loaded the set yet: 404, retry
            resp = httpx.post(f"{url}/v1/weights/experts/grouped-mm",
                              content=st_body({"x": x, "counts": counts}), timeout=60)
            if resp.status_code != 404:
                break
            time.sleep(0.05)
        ok = resp.status_code == 200 and torch.allclose(
            st_load(resp.content)["y"].double(), mm_ref(x, w, counts), atol=1e-4)
        return resp.headers.get("x-replica", "?"), ok, resp.status_code

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, cases * 2))
    bad = [(rep, status) for rep, ok, status in results if not ok]
    assert not bad, bad
    by_replica = Counter(rep for rep, _, _ in results)
    assert len(by_replica) == 2, (by_replica, uploaded_by)  # both replicas answered
    # the replica that did not take the upload loaded it from the shared data directory
    text = log_path.read_text()
    assert "from the shared data directory" in text, text[-4000:]
    # v2 (KServe's protocol) through the proxy too
    meta = httpx.get(f"{url}/v2/models/experts", headers=auth, timeout=30)
    assert meta.status_code == 200 and meta.json()["name"] == "experts"


def test_stop_shuts_the_replicas_down(ray_replicas) -> None:
    url, proc, log_path = ray_replicas
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0, log_path.read_text()[-4000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/v2/health/live", timeout=2)
