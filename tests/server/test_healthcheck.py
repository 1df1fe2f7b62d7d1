"""The container health check probes the port the server really listens on."""

from __future__ import annotations

import subprocess
import sys

import pytest
from server_testutils import REPO

from moe_gemm_server.healthcheck import find_server, probe, ready_url, server_args


@pytest.mark.parametrize("cmdline,args", [
    (["/opt/venv/bin/python3", "/opt/venv/bin/moe-gemm-server", "--port", "9000"],
     ["--port", "9000"]),
    (["moe-gemm-server"], []),
    (["python", "-m", "moe_gemm_server", "--host", "::"], ["--host", "::"]),
    (["python", "-m", "moe_gemm_client", "ready"], None),
    (["/usr/bin/tini", "--", "sleep", "1"], None),
])
def test_server_args(cmdline, args):
    assert server_args(cmdline) == args


def test_flag_wins_over_variable_wins_over_default():
    assert ready_url([], {}) == "http://127.0.0.1:8000/v2/health/ready"
    env = {"MOE_GEMM_PORT": "8100", "MOE_GEMM_HOST": "0.0.0.0"}
    assert ready_url([], env) == "http://127.0.0.1:8100/v2/health/ready"
    assert ready_url(["--port", "9000"], env) == "http://127.0.0.1:9000/v2/health/ready"
    assert ready_url(["--host", "::", "--port", "9000", "--api-key", "k"], {}) == \
        "http://[::1]:9000/v2/health/ready"
    assert ready_url(["--host", "10.1.2.3"], {}) == "http://10.1.2.3:8000/v2/health/ready"
    with pytest.raises(ValueError):
        ready_url([], {"MOE_GEMM_PORT": "http"})
    # a server with a certificate serves HTTPS only (flag or variable)
    assert ready_url(["--port", "9000", "--ssl-certfile", "c.pem"], {}) == \
        "https://127.0.0.1:9000/v2/health/ready"
    assert ready_url([], {"MOE_GEMM_SSL_CERTFILE": "/certs/c.pem"}) == \
        "https://127.0.0.1:8000/v2/health/ready"
    with pytest.raises(ValueError):
        ready_url(["--port", "0"], {})


def _fake_proc(root, cmdlines: dict[int, list[str]]):
    for pid, argv in cmdlines.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (root / "self").mkdir()
    return root


def test_find_server_prefers_pid_1_then_the_first_server(tmp_path):
    proc = _fake_proc(tmp_path / "a", {
        1: ["/opt/venv/bin/python3", "/opt/venv/bin/moe-gemm-server", "--port", "9000"],
        7: ["python", "-m", "moe_gemm_server", "--port", "9100"]})
    assert find_server(proc) == ["--port", "9000"]
    proc = _fake_proc(tmp_path / "b", {
        1: ["/sbin/docker-init", "--", "moe-gemm-server", "--port", "9200"],
        12: ["sleep", "5"]})
    assert find_server(proc) == ["--port", "9200"]
    proc = _fake_proc(tmp_path / "c", {1: ["/bin/sh"], 30: ["python", "-m", "moe_gemm_server"],
                                       40: ["moe-gemm-server", "--port", "1"]})
    assert find_server(proc) == []
    assert find_server(tmp_path / "none") == []


def test_probe_a_live_server_started_on_another_port_than_the_variable(main_server):
    """The server listens where its flag says, not where MOE_GEMM_PORT says."""
    port = main_server.url.rsplit(":", 1)[1]
    url = ready_url(["--host", "127.0.0.1", "--port", port], {"MOE_GEMM_PORT": "8000"})
    assert url == f"{main_server.url}/v2/health/ready"
    assert probe(url) == (True, "200")
    ok, seen = probe(f"http://127.0.0.1:{int(port) ^ 1}/v2/health/ready", timeout=1)
    assert not ok and seen


def test_module_exits_1_when_nothing_answers(tmp_path):
    proc = _fake_proc(tmp_path / "proc", {1: ["moe-gemm-server", "--port", "1"]})
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'server'}", "PATH": "/usr/bin:/bin"}
    code = ("import sys\nfrom pathlib import Path\nfrom moe_gemm_server import healthcheck\n"
            f"try:\n    healthcheck.main(Path({str(proc)!r}))\n"
            "finally:\n    print('torch imported:', 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert "healthcheck: http://127.0.0.1:1/v2/health/ready" in out.stderr, out.stderr
    assert out.stdout.strip() == "torch imported: False"
