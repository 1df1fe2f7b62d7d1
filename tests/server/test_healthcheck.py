"""The container health check probes the port the server really listens on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_a_host_no_url_can_hold_is_a_failed_probe_not_a_traceback(tmp_path):
    # (a server that never started, its MOE_GEMM_HOST holding a space: http.client's
    # InvalidURL escaped the probe as a traceback)
    url = ready_url(["--port", "1"], {"MOE_GEMM_HOST": "bad host"})
    ok, seen = probe(url, timeout=1)
    assert not ok and "bad host" in seen
    proc = _fake_proc(tmp_path / "proc", {1: ["moe-gemm-server", "--port", "1"]})
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'server'}", "PATH": "/usr/bin:/bin",
           "MOE_GEMM_HOST": "bad host"}
    code = ("from pathlib import Path\nfrom moe_gemm_server import healthcheck\n"
            f"healthcheck.main(Path({str(proc)!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("moe-gemm-server healthcheck: http://bad host:1/"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_probe_goes_past_a_proxy_the_environment_names(main_server, tmp_path):
    """HTTP_PROXY and friends (Docker sets them in every container from the client's proxy
    settings) must not carry the probe of the server's own port to a proxy, which cannot
    reach it: the server is ready, so the check passes."""
    port = main_server.url.rsplit(":", 1)[1]
    proc = _fake_proc(tmp_path / "proc", {1: ["moe-gemm-server", "--port", port]})
    dead = "http://127.0.0.1:9"  # (the discard port: nothing listens there)
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'server'}", "PATH": "/usr/bin:/bin",
           "HTTP_PROXY": dead, "http_proxy": dead, "HTTPS_PROXY": dead, "https_proxy": dead}
    code = ("from pathlib import Path\nfrom moe_gemm_server import healthcheck\n"
            f"healthcheck.main(Path({str(proc)!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr


def test_a_server_started_on_port_0_is_probed_on_the_port_it_listens_on(tmp_path):
    """--port 0 (a port the kernel picks) is read back from the server process's listening
    socket (/proc/PID/fd and /proc/PID/net/tcp*); where none is found it stays an error."""
    from moe_gemm_server.healthcheck import find_server_process, listening_port

    proc = _fake_proc(tmp_path / "p", {
        1: ["/sbin/docker-init", "--"], 7: ["moe-gemm-server", "--port", "0"]})
    (proc / "7" / "fd").mkdir()
    os.symlink("socket:[4242]", proc / "7" / "fd" / "5")
    os.symlink("/dev/null", proc / "7" / "fd" / "0")
    (proc / "7" / "net").mkdir()
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  " \
           "timeout inode\n"
    (proc / "7" / "net" / "tcp").write_text(
        head + "   0: 0100007F:1F90 00000000:0000 01 00000000:00000000 00:00000000 00000000 "
        "0 0 999 1\n"  # established, another socket
        "   1: 0100007F:A3F1 00000000:0000 0A 00000000:00000000 00:00000000 00000000 "
        "0 0 4242 1\n")
    (proc / "7" / "net" / "tcp6").write_text(head)
    assert find_server_process(proc) == (7, ["--port", "0"])
    assert listening_port(proc, 7) == 0xA3F1
    assert ready_url(["--port", "0"], {}, lambda: listening_port(proc, 7)) == \
        f"http://127.0.0.1:{0xA3F1}/v2/health/ready"
    assert listening_port(proc, 8) is None  # no such process
    with pytest.raises(ValueError):
        ready_url(["--port", "0"], {}, lambda: None)


def test_the_port_0_lookup_finds_a_real_listening_socket():
    """On this machine's own /proc: a socket this process listens on, on a kernel-picked
    port, is found."""
    import socket

    from moe_gemm_server.healthcheck import listening_port

    if not Path("/proc/self/net/tcp").exists():
        pytest.skip("no /proc/PID/net here")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert listening_port(Path("/proc"), os.getpid()) == s.getsockname()[1]
