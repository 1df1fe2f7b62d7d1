"""Helpers for the client tests: clients over httpx.MockTransport that never sleep for real.

`ContractHandler` is an in-memory stand-in for the server routes of docs/HTTP-API.md, written
with numpy: it decodes the safetensors bodies the client sends (so a test sees exactly what went
on the wire) and answers with the real matmul computed in float64, so round trips check numbers,
not just shapes. The live-server tests (test_live_server.py) cover the real server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

import moe_gemm_client
from moe_gemm_client._tensors import (
    BFLOAT16,
    decode_safetensors,
    dtype_name,
    encode_safetensors,
)


@dataclass
class Seen:
    method: str
    path: str
    headers: httpx.Headers
    body: bytes
    timeout: dict[str, Any] | None

    def tensors(self) -> dict[str, np.ndarray]:
        return decode_safetensors(self.body)


def error(status: int, message: str, request_id: str = "srv-id", **headers: str) -> httpx.Response:
    return httpx.Response(
        status,
        json={"error": message, "request_id": request_id},
        headers={"X-Request-Id": request_id, **headers},
    )


def st_response(tensors: dict[str, np.ndarray], request_id: str = "srv-id") -> httpx.Response:
    return httpx.Response(
        200,
        content=encode_safetensors(tensors).to_bytes(),
        headers={"Content-Type": "application/octet-stream", "X-Request-Id": request_id},
    )


def grouped_mm_ref(x: np.ndarray, w: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """float64 reference: rows of x grouped by expert, y[rows_e] = x[rows_e] @ w[e]."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    y = np.zeros((x.shape[0], w.shape[2]), np.float64)
    start = 0
    for e, c in enumerate(counts):
        y[start : start + c] = x64[start : start + c] @ w64[e]
        start += c
    return y


def dequantize_fp8(w8: np.ndarray, scale: np.ndarray, layout: str = "w") -> np.ndarray:
    """float64 (E, K, N) weights an FP8 upload stands for: fp8 x scale, the scale broadcast by
    its rank (3: 128x128 blocks, 2: per output channel (E, N), else per expert / one value),
    in the upload's orientation (w (E, K, N) or w_t (E, N, K))."""
    w = w8.astype(np.float64)
    s = np.asarray(scale, np.float64)
    if s.ndim == 3:
        s = np.repeat(np.repeat(s, 128, axis=1), 128, axis=2)[:, : w.shape[1], : w.shape[2]]
    elif s.ndim == 2:  # (E, N): N is axis 2 of w, axis 1 of w_t
        s = s[:, None, :] if layout == "w" else s[:, :, None]
    else:
        s = s.reshape(-1, 1, 1)
    w = w * s
    return w if layout == "w" else w.transpose(0, 2, 1)


@dataclass
class ContractHandler:
    """The HTTP contract in memory (happy paths plus the 4xx the contract names)."""

    weights: dict[str, tuple[np.ndarray, str]] = field(default_factory=dict)
    scales: dict[str, np.ndarray] = field(default_factory=dict)  # FP8 sets' "scale"
    seen: list[Seen] = field(default_factory=list)
    # GET /v1/weights' "not_loaded" entries; None: the key is left out (an older server)
    not_loaded: list[dict[str, object]] | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        self.seen.append(Seen(request.method, request.url.path, request.headers, body,
                              request.extensions.get("timeout")))
        rid = request.headers.get("x-request-id", "generated-id")
        path, method = request.url.path, request.method
        if path == "/v2/health/live":
            return httpx.Response(200, json={"live": True}, headers={"X-Request-Id": rid})
        if path == "/v2/health/ready":
            return httpx.Response(200, json={"ready": True}, headers={"X-Request-Id": rid})
        if path == "/v1/weights" and method == "GET":
            listing: dict[str, object] = {"weights": [self._info(n) for n in self.weights]}
            if self.not_loaded is not None:
                listing["not_loaded"] = self.not_loaded
            return httpx.Response(200, json=listing, headers={"X-Request-Id": rid})
        if path == "/v1/grouped-gemm" and method == "POST":
            return self._grouped_gemm(body, rid)
        m = re.fullmatch(r"/v1/weights/([^/]+)(/grouped-mm)?", path)
        if m is None:
            return error(404, f"no route {path}", rid)
        name = m.group(1)
        if m.group(2):
            return self._grouped_mm(name, body, rid)
        if method == "PUT":
            t = decode_safetensors(body)
            if "w" in t:
                w, layout = t["w"], "w"
            elif "w_t" in t:
                w, layout = np.ascontiguousarray(t["w_t"].transpose(0, 2, 1)), "w_t"
            else:
                return error(400, "missing tensor w or w_t", rid)
            status = 200 if name in self.weights else 201
            self.weights[name] = (w, layout)
            self.scales.pop(name, None)
            if "scale" in t:
                self.scales[name] = t["scale"]
            return httpx.Response(status, json=self._info(name), headers={"X-Request-Id": rid})
        if name not in self.weights:
            return error(404, f"unknown weight set {name!r}", rid)
        if method == "GET":
            return httpx.Response(200, json=self._info(name), headers={"X-Request-Id": rid})
        if method == "DELETE":
            del self.weights[name]
            return httpx.Response(200, json={"deleted": name}, headers={"X-Request-Id": rid})
        return error(405, "method not allowed", rid)

    def _info(self, name: str) -> dict[str, Any]:
        w, layout = self.weights[name]
        info = {"name": name, "experts": w.shape[0], "k": w.shape[1], "n": w.shape[2],
                "dtype": dtype_name(w.dtype), "bytes": int(w.nbytes), "layout": layout}
        if name in self.scales:  # FP8: the granularity, told apart by rank as the server does
            info["scales"] = {3: "block", 2: "row"}.get(self.scales[name].ndim, "tensor")
            info["bytes"] += int(self.scales[name].nbytes)
        return info

    def _grouped_mm(self, name: str, body: bytes, rid: str) -> httpx.Response:
        if name not in self.weights:
            return error(404, f"unknown weight set {name!r}", rid)
        w, _ = self.weights[name]
        t = decode_safetensors(body)
        x = t["x"]
        if "counts" in t:
            counts = t["counts"].astype(np.int64)
        else:
            offs = t["offs"].astype(np.int64)
            counts = np.diff(np.concatenate([[0], offs]))
        if x.shape[1] != w.shape[1]:
            return error(422, f"x has K={x.shape[1]}, weights have K={w.shape[1]}", rid)
        if len(counts) != w.shape[0] or (counts < 0).any() or counts.sum() != x.shape[0]:
            return error(422, "counts must be (E,) non-negative summing to T", rid)
        y = grouped_mm_ref(x, w, counts).astype(x.dtype)
        return st_response({"y": y}, rid)

    def _grouped_gemm(self, body: bytes, rid: str) -> httpx.Response:
        t = decode_safetensors(body)
        out = {}
        i = 0
        while f"a.{i}" in t:
            a, b = t[f"a.{i}"], t[f"b.{i}"]
            if a.shape[1] != b.shape[0]:
                return error(422, f"problem {i}: K mismatch", rid)
            out[f"d.{i}"] = (a.astype(np.float64) @ b.astype(np.float64)).astype(a.dtype)
            i += 1
        return st_response(out, rid)


Handler = Callable[[httpx.Request], httpx.Response]


def make_client(handler: Handler, **kwargs: Any) -> moe_gemm_client.Client:
    """A Client over a mock transport whose sleeps are recorded in client.sleeps, not slept."""
    client = moe_gemm_client.Client(
        http_client=httpx.Client(transport=httpx.MockTransport(handler)), **kwargs
    )
    client.sleeps = []  # type: ignore[attr-defined]
    client._sleep = client.sleeps.append  # type: ignore[attr-defined]
    return client


def make_async_client(handler: Handler, **kwargs: Any) -> moe_gemm_client.AsyncClient:
    client = moe_gemm_client.AsyncClient(
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)), **kwargs
    )
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    client.sleeps = sleeps  # type: ignore[attr-defined]
    client._sleep = fake_sleep  # type: ignore[attr-defined]
    return client


def bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(BFLOAT16)


def sequence(*responses: httpx.Response | Exception) -> tuple[Handler, list[httpx.Request]]:
    """A handler answering with the given responses (or raising the given exceptions) in
    order, repeating the last; it records every request."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        item = responses[min(len(seen) - 1, len(responses) - 1)]
        if isinstance(item, Exception):
            raise item
        # A fresh copy each time: a Response object belongs to one exchange.
        return httpx.Response(item.status_code, headers=item.headers, content=item.content)

    return handler, seen


def json_body(request: httpx.Request) -> Any:
    return json.loads(request.content)


# ------------------------------------------------------------------------------------------
# a real moe-gemm-server in a subprocess


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_pythonpath() -> str:
    """PYTHONPATH that makes the server (and moe_gemm) importable as in this process."""
    import importlib.util

    dirs = []
    for mod in ("moe_gemm_server", "moe_gemm"):
        spec = importlib.util.find_spec(mod)
        if spec is not None and spec.origin:
            dirs.append(os.path.dirname(os.path.dirname(spec.origin)))
    old = os.environ.get("PYTHONPATH")
    return os.pathsep.join(dirs + ([old] if old else []))


@contextlib.contextmanager
def running_server(data_dir: Path, *extra_args: str, ready_timeout: float = 120.0
                   ) -> Iterator[str]:
    """Start `python -m moe_gemm_server` on a free 127.0.0.1 port; yield its URL once
    /v2/health/ready answers 200; always stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.parent / f"server-{port}.log"
    env = {**os.environ, "PYTHONPATH": _server_pythonpath()}
    for key in [k for k in env if k.startswith("MOE_GEMM_")]:
        del env[key]  # flags only: no stray settings from the test environment
    cmd = [sys.executable, "-m", "moe_gemm_server", "--host", "127.0.0.1", "--port", str(port),
           "--data-dir", str(data_dir), *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n"
                                       f"{log_path.read_text(errors='replace')[-4000:]}")
                try:
                    if httpx.get(f"{url}/v2/health/ready", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready after {ready_timeout} s:\n"
                                       f"{log_path.read_text(errors='replace')[-4000:]}")
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@contextlib.contextmanager
def running_fake_server(handler: Handler | None = None) -> Iterator[str]:
    """Serve a handler (default: a fresh ContractHandler) over real HTTP on 127.0.0.1 with the
    standard library, for when the real server is not installed. Always shut down."""
    import http.server
    import threading

    app = handler or ContractHandler()

    class Adapter(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            request = httpx.Request(self.command, f"http://127.0.0.1{self.path}",
                                    headers=list(self.headers.items()), content=body)
            response = app(request)
            content = response.read()
            self.send_response(response.status_code)
            for k, v in response.headers.items():
                if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        do_GET = do_PUT = do_POST = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Adapter)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
