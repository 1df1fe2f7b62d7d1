"""Secure by default: the exposure check, TLS, and the audit log of admin actions."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from server_testutils import REPO, LiveServer, st_body

from moe_gemm_server import security
from moe_gemm_server.config import Settings
from moe_gemm_server.security import InsecureStart, check_exposure, check_tls, is_loopback, key_id

ADMIN = "audit-admin-key-7f3a9"
READER = "audit-reader-key-1"


# ------------------------------------------------------------------------------ unit checks


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost",
                                  "LOCALHOST"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.5", "example.com",
                                  "my-pod", ""])
def test_exposed_hosts(host: str) -> None:
    assert not is_loopback(host)


def test_exposed_without_admin_key_refuses(tmp_path: Path) -> None:
    s = Settings(host="0.0.0.0", data_dir=tmp_path)
    with pytest.raises(InsecureStart, match="refusing to listen on 0.0.0.0 without an admin key"):
        check_exposure(s)
    # API keys alone do not make it safe to expose: the brief is an admin key
    with pytest.raises(InsecureStart):
        check_exposure(Settings(host="0.0.0.0", api_key=["r"], data_dir=tmp_path))


def test_exposed_with_admin_key_or_opt_out(tmp_path: Path) -> None:
    ok = check_exposure(Settings(host="0.0.0.0", admin_key="a", api_key=["r"],
                                 ssl_certfile=tmp_path / "c.pem", data_dir=tmp_path))
    assert ok == []
    warned = check_exposure(Settings(host="0.0.0.0", insecure_no_auth=True, data_dir=tmp_path))
    assert any(w.startswith("INSECURE") and "open to anyone" in w for w in warned)
    assert any("without TLS" in w for w in warned)
    assert check_exposure(Settings(host="127.0.0.1", data_dir=tmp_path)) == []


def test_tls_files_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        check_tls(Settings(ssl_keyfile=tmp_path / "k.pem", data_dir=tmp_path))
    with pytest.raises(ValueError, match="--ssl-certfile .*missing.pem"):
        check_tls(Settings(ssl_certfile=tmp_path / "missing.pem", data_dir=tmp_path))


def test_tls_files_must_be_bounded_regular_files(tmp_path: Path, monkeypatch) -> None:
    # /dev/zero was read without end (gigabytes a second until the host ran out of memory)
    # and a FIFO with no writer hung the start; each is now one refusal naming the flag.
    with pytest.raises(ValueError, match="--ssl-certfile /dev/zero: not a regular file"):
        check_tls(Settings(ssl_certfile=Path("/dev/zero"), data_dir=tmp_path))
    fifo = tmp_path / "cert.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"--ssl-certfile .*cert.fifo: not a regular file"):
        check_tls(Settings(ssl_certfile=fifo, data_dir=tmp_path))
    with pytest.raises(ValueError, match=r"--ssl-certfile .*: not a regular file"):
        check_tls(Settings(ssl_certfile=tmp_path, data_dir=tmp_path))
    (tmp_path / "a").mkdir()
    cert, _ = _self_signed(tmp_path / "a")
    with pytest.raises(ValueError, match="--ssl-keyfile /dev/urandom: not a regular file"):
        check_tls(Settings(ssl_certfile=cert, ssl_keyfile=Path("/dev/urandom"),
                           data_dir=tmp_path))
    monkeypatch.setattr(security, "MAX_PEM_BYTES", 64)
    with pytest.raises(ValueError, match=r"--ssl-certfile .*cert.pem: larger than 64 bytes"):
        check_tls(Settings(ssl_certfile=cert, data_dir=tmp_path))


def test_key_id_is_stable_and_not_the_key() -> None:
    kid = key_id(ADMIN)
    assert kid == "sha256:" + hashlib.sha256(ADMIN.encode()).hexdigest()[:12]
    assert ADMIN not in kid and key_id(ADMIN) == kid and key_id("other") != kid
    assert key_id(None) == "none"


# ------------------------------------------------------------------------------ the CLI


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GEMM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "server")])
    return subprocess.run([sys.executable, "-m", "moe_gemm_server", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_refuses_exposed_start_with_one_line(tmp_path: Path) -> None:
    proc = _cli("--host", "0.0.0.0", "--port", "0", "--data-dir", str(tmp_path))
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("moe-gemm-server: refusing to listen on 0.0.0.0")
    assert "--insecure-no-auth" in lines[0] and "--admin-key" in lines[0]
    # the environment variable counts as the flag
    env_proc = subprocess.run(
        [sys.executable, "-m", "moe_gemm_server", "--port", "0", "--data-dir", str(tmp_path)],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("MOE_GEMM_")},
             "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "server")]),
             "MOE_GEMM_HOST": "::"},
        capture_output=True, text=True, timeout=60)
    assert env_proc.returncode != 0 and "refusing to listen on ::" in env_proc.stderr


def test_cli_bad_tls_file_is_one_line(tmp_path: Path) -> None:
    proc = _cli("--port", "0", "--data-dir", str(tmp_path), "--ssl-certfile",
                str(tmp_path / "nope.pem"))
    assert proc.returncode != 0
    assert proc.stderr.strip().startswith("moe-gemm-server: --ssl-certfile")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_insecure_opt_out_starts_and_warns_every_start(tmp_path: Path) -> None:
    # bind every interface (the last --host wins); the test talks to it over loopback only
    server = LiveServer(tmp_path / "data", "--host", "0.0.0.0", "--insecure-no-auth",
                        "--warmup-rows", "1")
    for start in (1, 2):  # every start warns, not only the first (one log file, appended)
        try:
            server.start()
            assert httpx.get(f"{server.url}/v2/health/live", timeout=5).status_code == 200
        finally:
            server.stop()
        assert server.log().count("INSECURE: listening on 0.0.0.0") == start


# ------------------------------------------------------------------------------ TLS + audit


def _self_signed(dir: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = dir / "cert.pem", dir / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, str, Path]]:
    """An HTTPS server with keys, at log level warning (audit lines must still appear)."""
    root = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(root)
    server = LiveServer(root / "data", "--admin-key", ADMIN, "--api-key", READER,
                        "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                        "--log-level", "warning", "--warmup-rows", "1")
    url = f"https://127.0.0.1:{server.port}"
    ctx = ssl.create_default_context(cafile=str(cert))
    try:
        server.start(wait=False)
        deadline = time.monotonic() + 60
        while True:
            assert server.proc is not None and server.proc.poll() is None, server.log()
            try:
                if httpx.get(f"{url}/v2/health/ready", verify=ctx, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        yield server, url, cert
    finally:
        server.stop()


def test_healthcheck_probes_a_tls_server(tls_server: tuple[LiveServer, str, Path]) -> None:
    """The container health check follows the server to HTTPS (a self-signed certificate)."""
    from moe_gemm_server.healthcheck import probe, ready_url

    server, url, cert = tls_server
    args = ["--port", str(server.port), "--ssl-certfile", str(cert)]
    assert ready_url(args, {}) == f"{url}/v2/health/ready"
    assert probe(ready_url(args, {})) == (True, "200")


def test_https_client_round_trip(tls_server: tuple[LiveServer, str, Path]) -> None:
    from moe_gemm_client import Client

    server, url, cert = tls_server
    ctx = ssl.create_default_context(cafile=str(cert))
    w = torch.randn(2, 8, 4)
    with httpx.Client(verify=ctx) as http, Client(url, api_key=ADMIN, http_client=http) as c:
        c.put_weights("tls-set", w)
        x = torch.randn(5, 8)
        y = c.grouped_mm("tls-set", x, counts=[2, 3])
    ref = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    assert torch.allclose(y, ref, atol=1e-5)
    # plain HTTP to the TLS port does not get an answer; an unverified certificate is refused
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.port}/v2/health/live", timeout=3)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v2/health/live", timeout=3)  # the system CAs do not know it


def test_admin_actions_are_audited_with_key_id_never_the_key(
        tls_server: tuple[LiveServer, str, Path]) -> None:
    server, url, cert = tls_server
    ctx = ssl.create_default_context(cafile=str(cert))
    body = st_body({"w": torch.randn(2, 4, 4)})
    with httpx.Client(base_url=url, verify=ctx, timeout=30) as h:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert h.put("/v1/weights/audited", content=body, headers=admin).status_code == 201
        assert h.put("/v1/weights/audited", content=body, headers=admin).status_code == 200
        bad = h.put("/v1/weights/audited", content=body,
                    headers={"Authorization": "Bearer wrong-key-123"})
        assert bad.status_code == 403
        assert h.put("/v1/weights/audited", content=b"junk", headers=admin).status_code == 400
        assert h.delete("/v1/weights/audited", headers=admin).status_code == 200
        assert h.delete("/v1/weights/audited", headers={
            "Authorization": f"Bearer {READER}"}).status_code == 403
    deadline = time.monotonic() + 10
    while server.log().count(" name=audited ") < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log()
    lines = [ln for ln in log.splitlines() if " audit action=" in ln and " name=audited " in ln]
    kid = key_id(ADMIN)
    want = [
        ("put_weights", "ok", 201, kid), ("put_weights", "ok", 200, kid),
        ("put_weights", "refused", 403, key_id("wrong-key-123")),
        ("put_weights", "refused", 400, kid), ("delete_weights", "ok", 200, kid),
        ("delete_weights", "refused", 403, key_id(READER)),
    ]
    got = []
    for ln in lines:
        fields = dict(f.split("=", 1) for f in ln.split(" audit ", 1)[1].split() if "=" in f)
        got.append((fields["action"], fields["outcome"], int(fields["status"]), fields["key_id"]))
        assert fields["client"].startswith("127.0.0.1:")
    assert got == want, lines
    for secret in (ADMIN, READER, "wrong-key-123"):
        assert secret not in log



# ------------------------------------------------------------------------------ bad TLS files


def _tls_refusal(tmp_path: Path, *tls_args: str) -> str:
    """The start is refused with one line naming the file, before "listening on" is logged."""
    proc = _cli("--port", "0", "--data-dir", str(tmp_path / "data"), *tls_args)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "listening on" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moe-gemm-server: --ssl-"), proc.stderr
    return lines[0]


def test_cli_refuses_a_certfile_that_is_not_pem(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("this is not a certificate\n")
    line = _tls_refusal(tmp_path, "--ssl-certfile", str(garbage))
    assert line == (f"moe-gemm-server: --ssl-certfile {garbage}: no PEM certificate in it "
                    "(expected a -----BEGIN CERTIFICATE----- block)")


def test_check_tls_loads_the_pair(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cert, key = _self_signed(tmp_path / "a")
    _, other_key = _self_signed(tmp_path / "b")
    check_tls(Settings(ssl_certfile=cert, ssl_keyfile=key, data_dir=tmp_path))  # a good pair
    with pytest.raises(ValueError, match=r"--ssl-certfile .*cert.pem: no PEM private key in "
                                         r"it \(give the key with --ssl-keyfile\)"):
        check_tls(Settings(ssl_certfile=cert, data_dir=tmp_path))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("nope")
    with pytest.raises(ValueError, match=r"--ssl-keyfile .*garbage.pem: no PEM private key"):
        check_tls(Settings(ssl_certfile=cert, ssl_keyfile=garbage, data_dir=tmp_path))
    with pytest.raises(ValueError, match="the private key does not match the certificate"):
        check_tls(Settings(ssl_certfile=cert, ssl_keyfile=other_key, data_dir=tmp_path))
    corrupt = tmp_path / "corrupt.pem"
    corrupt.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(ValueError, match="not a usable certificate and key: unreadable PEM"):
        check_tls(Settings(ssl_certfile=cert, ssl_keyfile=corrupt, data_dir=tmp_path))
    # an encrypted key would make uvicorn prompt for a password on the terminal (a hang)
    encrypted = tmp_path / "enc.pem"
    encrypted.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(ValueError, match=r"--ssl-keyfile .*enc.pem: the private key is "
                                         r"encrypted"):
        check_tls(Settings(ssl_certfile=cert, ssl_keyfile=encrypted, data_dir=tmp_path))


def test_cli_refuses_a_mismatched_key_before_listening(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cert, _ = _self_signed(tmp_path / "a")
    _, other_key = _self_signed(tmp_path / "b")
    line = _tls_refusal(tmp_path, "--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key))
    assert str(cert) in line and str(other_key) in line and "does not match" in line
