"""Helpers for the server tests: a real `python -m moe_gemm_server` process, bodies, references.

The process runs on 127.0.0.1 on a free port, with its output in a log file; every wait is
bounded in time, and the context manager always stops the process (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
from safetensors.torch import load, save

from moe_gemm_server.engine import Engine

REPO = Path(__file__).resolve().parents[2]

# The shared live server's keys and limits (tests/server/conftest.py starts it).
API_KEY = "reader-key-1"
API_KEY_2 = "reader-key-2"
ADMIN_KEY = "admin-key-0"
MAX_BODY = 1 << 20
MAX_ROWS = 4096
MAX_FLOPS = 2_000_000_000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pythonpath() -> str:
    parts = [str(REPO), str(REPO / "server")]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


class LiveServer:
    """One server process. `start()` returns once /v2/health/ready answers 200."""

    def __init__(self, data_dir: Path, *args: str, log_dir: Path | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.args = args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = (log_dir or self.data_dir.parent) / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout: float = 60.0, wait: bool = True) -> LiveServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GEMM_")}
        env["PYTHONPATH"] = _pythonpath()
        cmd = [sys.executable, "-m", "moe_gemm_server", "--host", "127.0.0.1",
               "--port", str(self.port), "--data-dir", str(self.data_dir), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_ready(ready_timeout)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the process and wait for it; SIGKILL if it does not exit in time."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def live_server(data_dir: Path, *args: str, ready_timeout: float = 60.0) -> Iterator[LiveServer]:
    server = LiveServer(data_dir, *args)
    try:
        server.start(ready_timeout)
        yield server
    finally:
        server.stop()


class GatedEngine(Engine):
    """prepare_weights of the set named `gated` waits until `release` is set (after setting
    `entered`): a load held in flight between its budget check and its install."""

    def __init__(self, gated: str) -> None:
        super().__init__("cpu", warmup_rows=[1])
        self.gated = gated
        self.entered = threading.Event()
        self.release = threading.Event()

    def prepare_weights(self, name, tensor, layout="w", *, warm=True, scale=None):
        if name == self.gated:
            self.entered.set()
            assert self.release.wait(30)
        return super().prepare_weights(name, tensor, layout, warm=warm, scale=scale)


def wait_event(event: threading.Event, what: str) -> None:
    assert event.wait(10), what


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0.0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


def st_body(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.contiguous() for k, v in tensors.items()})


def st_load(body: bytes) -> dict[str, torch.Tensor]:
    return load(body)


def random_counts(T: int, E: int, gen: torch.Generator, empty: int | None = None
                  ) -> torch.Tensor:
    experts = [e for e in range(E) if e != empty]
    idx = torch.tensor(experts)[torch.randint(0, len(experts), (T,), generator=gen)]
    return torch.bincount(idx, minlength=E).to(torch.int32)


def mm_ref(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """float64 reference of the grouped mm (x rows grouped by counts times w[e])."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts.tolist()):
        out[start:start + c] = x[start:start + c].double() @ w[e].double()
        start += c
    return out


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def served(client, name: str, w: torch.Tensor) -> bool:
    """Whether the set `name` answers a grouped-mm with `w`'s product (3 rows, expert 0): a
    client (TestClient, httpx) that posts to the service."""
    x = torch.randn(3, w.shape[1])
    counts = torch.tensor([3] + [0] * (w.shape[0] - 1))
    r = client.post(f"/v1/weights/{name}/grouped-mm",
                    content=st_body({"x": x, "counts": counts}))
    return r.status_code == 200 and torch.allclose(
        st_load(r.content)["y"].double(), mm_ref(x, w, counts), atol=1e-4)


def assert_close_to_ref(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """|y - ref| within the dtype's rounding of the output (relative to the output's scale)."""
    assert y.shape == ref.shape
    if ref.numel() == 0:
        return
    scale = ref.abs().max().item()
    assert scale > 0
    err = (y.double() - ref).abs().max().item()
    assert err <= TOL[dtype] * scale * 2 + 1e-6, (err, scale)


def read_http_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one HTTP/1.1 response with a
    Content-Length, read from a raw socket."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the response head"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the end of the body"
        body += chunk
    return int(lines[0].split()[1]), headers, body
