"""Randomized malformed JSON requests: a valid body of each matmul route (native grouped-mm,
grouped-gemm, v2 infer) with one to three of its nodes replaced, removed or added, as a buggy
client would send it. The service answers 2xx (a change that is still valid input) or 4xx with
a JSON {"error": ...}; never a 5xx, a non-JSON answer or a dropped connection.

Fresh cases every run; MOE_GEMM_FUZZ_SEED replays one (the failure message names it).
"""

from __future__ import annotations

import copy
import json
import os
import random
import secrets
import time
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from server_testutils import st_body

from moe_gemm_server import Settings, create_app

SEED = int(os.environ.get("MOE_GEMM_FUZZ_SEED") or secrets.randbits(31))
CASES = int(os.environ.get("MOE_GEMM_FUZZ_CASES") or 120)
# What a buggy client puts where a value belongs.
JUNK = [None, True, False, 0, -1, 1.5, -2**31 - 1, 2**63, 1e308, float("nan"), "", "1", "x",
        "FP32", [], [[]], [[1, 2], [3]], {}, {"a": 1}, [None], ["1"], [True], [1e39],
        list(range(70))]


def _nodes(doc: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every node below the root (dict keys and list indices)."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append(path + (k,))
            out += _nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:8]):  # (the first few elements of a long list)
            out.append(path + (i,))
            out += _nodes(v, path + (i,))
    return out


def _junk(r: random.Random) -> Any:
    """A JUNK value as a new object: a shared one, mutated by a later step of the same case,
    would change JUNK for every later case or end up inside itself (a circular document)."""
    return copy.deepcopy(r.choice(JUNK))


def _mutate(doc: Any, r: random.Random) -> tuple[Any, str]:
    doc = copy.deepcopy(doc)
    done = []
    for _ in range(r.randint(1, 3)):
        paths = _nodes(doc)
        if not paths:
            break
        path = r.choice(paths)
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        key = path[-1]
        action = r.choice(["replace", "replace", "remove", "add", "wrap", "duplicate"])
        if action == "replace":
            parent[key] = _junk(r)
        elif action == "remove":
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[r.choice(["extra", "X", "dtype", "parameters", "outputs", "id"])] = _junk(r)
        elif action == "add":
            parent.append(_junk(r))
        elif action == "wrap":
            parent[key] = [parent[key]]
        else:
            if isinstance(parent, list):
                parent.append(copy.deepcopy(parent[key]))
            else:
                parent[str(key) + "_"] = copy.deepcopy(parent[key])
        done.append(f"{action} {'/'.join(map(str, path))}")
    return doc, "; ".join(done)


def _bodies(r: random.Random) -> dict[str, Any]:
    T, K, E = r.randint(0, 6), 4, 2  # (the weight set m: E=2, K=4, N=3)
    x = [[round(r.uniform(-2, 2), 3) for _ in range(K)] for _ in range(T)]
    c0 = r.randint(0, T)
    return {
        "/v1/weights/m/grouped-mm": {"x": x, "counts": [c0, T - c0]} if r.random() < 0.5
        else {"x": x, "offs": [c0, T], "dtype": "float32"},
        "/v1/grouped-gemm": {"a": [[[1.0, 2.0]], [[1.0], [2.0]]],
                             "b": [[[3.0], [4.0]], [[5.0, 6.0]]]},
        "/v2/models/m/infer": {"id": "q", "inputs": [
            {"name": "x", "shape": [T, K], "datatype": "FP32",
             "data": [v for row in x for v in row]},
            {"name": "counts", "shape": [E], "datatype": "INT32", "data": [c0, T - c0]}],
            "outputs": [{"name": "y"}]},
    }


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    data = tmp_path_factory.mktemp("json-fuzz") / "d"
    with TestClient(create_app(Settings(data_dir=data)), raise_server_exceptions=False) as c:
        deadline = time.monotonic() + 30
        while c.get("/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert c.put("/v1/weights/m", content=st_body({"w": torch.randn(2, 4, 3)})
                     ).status_code == 201
        yield c


@pytest.mark.parametrize("i", range(CASES))
def test_malformed_json_gets_a_4xx_with_an_error(client, i):
    r = random.Random(f"{SEED}/json/{i}")
    route, body = r.choice(sorted(_bodies(r).items()))
    bad, what = _mutate(body, r)
    text = json.dumps(bad, allow_nan=True)  # (NaN as a client's JSON encoder may write it)
    resp = client.post(route, content=text, headers={"Content-Type": "application/json"})
    where = f"seed={SEED} case {i}: POST {route} ({what}) -> {resp.status_code} {resp.text[:300]}"
    assert resp.status_code < 500, where
    assert resp.headers.get("content-type", "").startswith("application/json"), where
    answer = resp.json()
    if resp.status_code >= 400:
        assert isinstance(answer.get("error"), str) and answer["error"], where
    else:
        assert resp.status_code == 200, where
