"""Weight uploads against the resident budget (service_weights.WeightsMixin), in-process: the
507 of a replacement that does not fit says how the free bytes it names were counted."""

from __future__ import annotations

import time

import torch
from fastapi.testclient import TestClient
from server_testutils import st_body

from moe_gemm_server import Settings, create_app
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
