"""Install the client alone into a fresh venv (no torch), then do a round trip from it.

Proves the promise of the package: `pip install moe-gemm-client` pulls httpx, numpy,
safetensors and ml_dtypes only, never torch, and everything works with numpy and bfloat16
arrays. The server is the real one (started from this environment) when moe_gemm_server is
importable, else a standard-library HTTP server speaking the same contract.
Needs PyPI (or a pip cache/mirror) for the four dependencies.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from moe_client_testutils import running_fake_server, running_server

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"

ROUND_TRIP = textwrap.dedent(
    """
    import asyncio, sys
    import ml_dtypes, numpy as np
    import moe_gemm_client as mgc

    url = sys.argv[1]
    rng = np.random.default_rng(0)
    E, K, N = 3, 32, 16
    w = rng.standard_normal((E, K, N)).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((9, K)).astype(ml_dtypes.bfloat16)
    counts = [4, 0, 5]
    with mgc.Client(url) as c:
        assert c.ready()
        info = c.put_weights("venv-w", w)
        assert (info.experts, info.k, info.n, info.dtype) == (E, K, N, "bfloat16"), info
        assert "venv-w" in [i.name for i in c.list_weights()]
        y = c.grouped_mm("venv-w", x, counts=counts)
        assert y.dtype == ml_dtypes.bfloat16 and y.shape == (9, N), (y.dtype, y.shape)
        ref = np.zeros((9, N))
        start = 0
        for e, n in enumerate(counts):
            ref[start:start + n] = x[start:start + n].astype(np.float64) @ w[e].astype(np.float64)
            start += n
        err = np.abs(y.astype(np.float64) - ref).max()
        assert 0 < np.abs(ref).max() and err <= 3e-2 * np.abs(ref).max(), err
        d = c.grouped_gemm([x.astype(np.float32)], [w[0].astype(np.float32)])
        np.testing.assert_allclose(d[0], x.astype(np.float32) @ w[0].astype(np.float32),
                                   rtol=1e-4, atol=1e-4)
        try:
            c.get_weights("venv-missing")
        except mgc.NotFoundError as exc:
            assert exc.status_code == 404
        else:
            raise AssertionError("expected NotFoundError")

    async def go():
        async with mgc.AsyncClient(url) as ac:
            y2 = await ac.grouped_mm("venv-w", x, counts=counts)
            await ac.delete_weights("venv-w")
            return y2

    np.testing.assert_array_equal(asyncio.run(go()).astype(np.float32), y.astype(np.float32))
    assert "torch" not in sys.modules
    print("round trip ok")
    """
)


# pip's messages when no index can be reached at all (not when a requirement is unsatisfiable).
_OFFLINE = ("NewConnectionError", "Temporary failure in name resolution",
            "Network is unreachable", "ConnectTimeoutError", "No route to host")


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.slow
def test_fresh_venv_install_without_torch(tmp_path):
    # Build from a copy, so pip's in-tree build leaves nothing behind in the repository.
    src = tmp_path / "client-src"
    shutil.copytree(CLIENT_DIR, src,
                    ignore=shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__"))
    venv = tmp_path / "venv"
    out = _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    assert out.returncode == 0, out.stderr
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    py = str(bindir / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    out = _run([py, "-m", "pip", "install", "-q", str(src)], timeout=300, env=env)
    if out.returncode != 0 and any(s in out.stderr for s in _OFFLINE):
        pytest.skip(f"no package index reachable: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stdout + out.stderr

    out = _run([py, "-m", "pip", "list", "--format=json"], timeout=60, env=env)
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(out.stdout)}
    assert {"moe-gemm-client", "httpx", "numpy", "safetensors", "ml-dtypes"} <= installed
    assert not {"torch", "nvidia-cutlass-dsl", "moe-gemm"} & installed, installed
    out = _run([py, "-c", "import torch"], timeout=60, env=env)
    assert out.returncode != 0 and "No module named 'torch'" in out.stderr

    data = tmp_path / "server-data"
    if importlib.util.find_spec("moe_gemm_server") is not None:
        server = running_server(data)
    else:
        server = running_fake_server()
    with server as url:
        out = _run([py, "-c", ROUND_TRIP, url], timeout=120, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "round trip ok" in out.stdout
        cli = str(bindir / "moe-gemm-client")
        out = _run([cli, "--url", url, "health"], timeout=60, env=env)
        assert out.returncode == 0 and json.loads(out.stdout) == {"live": True}, out.stderr
        out = _run([cli, "--url", url, "list", "--json"], timeout=60, env=env)
        assert out.returncode == 0 and json.loads(out.stdout) == {"weights": [], "not_loaded": []}, out.stderr
