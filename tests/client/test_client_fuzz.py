"""Randomized client mistakes, end to end: the client over the real service in-process (its
ASGI app behind httpx), each call of put_weights / grouped_mm / grouped_gemm with one or two
arguments replaced by a likely mistake. The call returns (a still-valid input, checked
against a float64 reference), raises TypeError / ValueError before sending, or raises the
client's 4xx error class; never a 5xx, another exception type or a wrong answer.

Fresh cases every run; MOE_GEMM_FUZZ_SEED replays one (the failure message names it).
"""

from __future__ import annotations

import os
import random
import secrets
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

import moe_gemm_client as mgc
from moe_gemm_server import Settings, create_app

SEED = int(os.environ.get("MOE_GEMM_FUZZ_SEED") or secrets.randbits(31))
CASES = int(os.environ.get("MOE_GEMM_FUZZ_CASES") or 120)
E, K, N = 3, 8, 5


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    data = tmp_path_factory.mktemp("client-fuzz") / "d"
    with TestClient(create_app(Settings(data_dir=data)), raise_server_exceptions=False) as http:
        c = mgc.Client(base_url="http://testserver", max_retries=0,
                       http_client=httpx.Client(transport=_Forward(http)))
        c.wait_until_ready(30.0)
        w = np.random.default_rng(0).standard_normal((E, K, N)).astype(np.float32)
        c.put_weights("m", w)
        yield c, w


class _Forward(httpx.BaseTransport):
    """httpx requests answered by the app through Starlette's test client (which brings its
    own HTTP client class)."""

    def __init__(self, app_client: TestClient):
        self.app_client = app_client

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url.raw_path.decode()
        resp = self.app_client.request(request.method, url, headers=dict(request.headers),
                                       content=request.read())
        return httpx.Response(resp.status_code, headers=list(resp.headers.items()),
                              content=resp.content)


def _mistake(value: Any, r: random.Random) -> Any:
    kind = r.choice(["none", "str", "int", "float64", "int64", "3-D", "1-D", "short", "nan",
                     "list", "empty", "bool", "negative", "transposed"])
    a = np.asarray(value) if not isinstance(value, (str, type(None))) else value
    if not isinstance(a, np.ndarray):
        return None
    return {"none": None, "str": "x", "int": 7, "float64": a.astype(np.float64),
            "int64": a.astype(np.int64), "3-D": a[None], "1-D": a.reshape(-1),
            "short": a[..., :-1] if a.ndim and a.shape[-1] else a,
            "nan": np.full_like(a, np.nan, dtype=np.float32) if a.size else a,
            "list": a.tolist(), "empty": a[:0], "bool": a != 0, "negative": -np.abs(a) - 1,
            "transposed": a.T}[kind]


def _run(client, i: int, what: str, call, check) -> None:
    try:
        out = call()
    except (TypeError, ValueError):
        return
    except mgc.APIStatusError as exc:
        assert exc.status_code < 500, f"seed={SEED} case {i} ({what}): {exc!r}"
        return
    except Exception as exc:  # noqa: BLE001 - the point: name the wrong exception type
        raise AssertionError(f"seed={SEED} case {i} ({what}): {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from None
    check(out)


@pytest.mark.parametrize("i", range(CASES))
def test_client_mistakes_end_to_end(client, i):
    c, w = client
    r = random.Random(f"{SEED}/client/{i}")
    rng = np.random.default_rng(r.randrange(1 << 31))
    op = r.choice(["grouped_mm", "grouped_mm", "grouped_gemm", "put_weights"])
    if op == "grouped_mm":
        T = r.randint(0, 9)
        counts = np.bincount(rng.integers(0, E, T), minlength=E).astype(np.int32)
        args = {"x": rng.standard_normal((T, K)).astype(np.float32), "counts": counts}
        if r.random() < 0.3:
            args = {"x": args["x"], "offs": np.cumsum(counts).astype(np.int32)}
        for name in r.sample(sorted(args), r.choice([1, 2]) if len(args) > 1 else 1):
            args[name] = _mistake(args[name], r)

        def check(y):
            x = np.asarray(args["x"], dtype=np.float64)
            cnt = (np.asarray(args["counts"]) if "counts" in args
                   else np.diff(np.concatenate([[0], np.asarray(args["offs"])])))
            ends = np.cumsum(cnt)
            ref = np.zeros((x.shape[0], N))
            start = 0
            for e, end in enumerate(ends):
                ref[start:end] = x[start:end] @ w[e].astype(np.float64)
                start = end
            np.testing.assert_allclose(np.asarray(y, dtype=np.float64), ref, rtol=1e-4,
                                       atol=1e-4)

        _run(c, i, f"grouped_mm {sorted(args)}", lambda: c.grouped_mm("m", **args), check)
    elif op == "grouped_gemm":
        G = r.randint(1, 3)
        a = [rng.standard_normal((r.randint(0, 4), 3)).astype(np.float32) for _ in range(G)]
        b = [rng.standard_normal((3, r.randint(1, 4))).astype(np.float32) for _ in range(G)]
        j = r.randrange(G)
        if r.random() < 0.5:
            a[j] = _mistake(a[j], r)
        else:
            b[j] = _mistake(b[j], r)

        def check(d):
            assert len(d) == G
            for di, ai, bi in zip(d, a, b):
                np.testing.assert_allclose(np.asarray(di, dtype=np.float64),
                                           np.asarray(ai, np.float64) @ np.asarray(bi, np.float64),
                                           rtol=1e-4, atol=1e-4)

        _run(c, i, "grouped_gemm", lambda: c.grouped_gemm(a, b), check)
    else:
        name = r.choice(["n1", "a b", "", "../x", "x" * 300, "ok-name", 3])
        wt = _mistake(rng.standard_normal((2, 4, 3)).astype(np.float32), r) if (
            r.random() < 0.7) else rng.standard_normal((2, 4, 3)).astype(np.float32)

        def check(info):
            assert info is not None

        _run(c, i, f"put_weights {name!r}", lambda: c.put_weights(name, wt), check)
