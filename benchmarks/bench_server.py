"""Load benchmark of moe-gemm-server: requests/s and p50/p99 latency vs. concurrency.

Starts its own server (`python -m moe_gemm_server`) on 127.0.0.1 for each batching mode
(on: the default dynamic batcher; off: `--no-batching`, one request per launch), uploads one
weight set, and drives POST /v1/weights/{name}/grouped-mm with a small and a large request at
each concurrency level from load-generator processes on the same machine. Every answer's
status is checked, and one answer per configuration is compared with a float64 reference, so
the numbers are for correct work. The mean requests and rows per launch come from the
server's own metrics (moe_gemm_batch_requests / moe_gemm_batch_rows).

The client is a minimal keep-alive HTTP/1.1 client on asyncio streams (one connection per
simulated client), so the load generator costs little CPU next to the server.

    python benchmarks/bench_server.py --out benchmarks/results/server-cpu-2026-11-21.json
    python benchmarks/bench_server.py --out FILE          # on the GPU machine, unchanged

Sizes follow the device the server will use (CUDA if available, else CPU); see SIZES.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

# Weight set and request rows per device. CPU: small enough that the 2-core CI machine
# measures the server, not BLAS; CUDA: an MoE layer slice (bf16) with 64-row (256 KiB) and
# 1024-row (4 MiB) requests: bigger bodies measure HTTP byte shuffling in Python, not the GPU.
SIZES = {
    "cpu": {"experts": 8, "k": 256, "n": 256, "dtype": "float32",
            "rows": {"small": 16, "large": 1024}},
    "cuda": {"experts": 64, "k": 2048, "n": 1024, "dtype": "bfloat16",
             "rows": {"small": 64, "large": 1024}},
}
# Batching modes: the server's dynamic batcher on, or off (--no-batching).
MODES = ("on", "off")


# --------------------------------------------------------------------------- tiny HTTP client


class Conn:
    """One keep-alive HTTP/1.1 connection (Content-Length bodies only)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        for attempt in (0, 1):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            try:
                self.writer.write(head + body)
                await self.writer.drain()
                return await self._response()
            except (ConnectionError, asyncio.IncompleteReadError):
                await self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _response(self) -> tuple[int, bytes]:
        assert self.reader is not None
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length, close = 0, False
        for line in lines[1:]:
            k, _, v = line.partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "connection" and v.strip().lower() == "close":
                close = True
        body = await self.reader.readexactly(length)
        if close:
            await self.close()
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        self.reader = self.writer = None


def _head(path: str, host: str, length: int, api_key: str | None) -> bytes:
    h = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
         f"Content-Length: {length}\r\n")
    if api_key:
        h += f"Authorization: Bearer {api_key}\r\n"
    return (h + "\r\n").encode()


async def _drive(host: str, port: int, head: bytes, body: bytes, clients: int,
                 t_measure: float, t_end: float) -> tuple[list[float], float, int]:
    """`clients` concurrent loops, each sending requests back to back until `t_end` (wall
    clock, time.time(), shared by all load processes). A request counts if it started at or
    after `t_measure`; requests in flight at `t_end` are waited for and counted, so slow
    points (latency near or above the window) still measure. Returns the latencies (s) of the
    counted successes, the wall time the last counted request finished, and the errors."""
    lat: list[float] = []
    errors = 0
    last = t_measure

    async def loop() -> None:
        nonlocal errors, last
        conn = Conn(host, port)
        try:
            while time.time() < t_end:
                started = time.time()
                t0 = time.perf_counter()
                try:
                    status, _ = await conn.request(head, body)
                except (ConnectionError, OSError, asyncio.IncompleteReadError):
                    status = -1
                t1 = time.perf_counter()
                if started >= t_measure:
                    last = max(last, time.time())
                    if status == 200:
                        lat.append(t1 - t0)
                    else:
                        errors += 1
        finally:
            await conn.close()

    await asyncio.gather(*(loop() for _ in range(clients)))
    return lat, last, errors


def _worker(args: tuple) -> tuple[list[float], float, int]:
    host, port, head, body, clients, t_measure, t_end = args
    return asyncio.run(_drive(host, port, head, body, clients, t_measure, t_end))


# --------------------------------------------------------------------------- server control


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = _free_port()
        self.data = Path(tempfile.mkdtemp(prefix="moe-gemm-bench-"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GEMM_")}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), str(REPO / "server")] + ([env["PYTHONPATH"]] if "PYTHONPATH" in env
                                                 else []))
        cmd = [sys.executable, "-m", "moe_gemm_server", "--host", "127.0.0.1", "--port",
               str(self.port), "--data-dir", str(self.data), "--log-level", "warning", *args]
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, bytes]:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def request(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/octet-stream"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def wait_ready(self, timeout: float = 900.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if self.get("/v2/health/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server not ready in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --------------------------------------------------------------------------- main


def _st(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def _out_path(text: str) -> Path:
    """--out, checked when argparse reads it (argcheck.out_argument; run as a script, this
    file does not import the benchmarks package)."""
    from moe_gemm.tuning.argcheck import out_argument

    return Path(out_argument(text))


def _arg_problem(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot make a run, or None (checked before any server starts: an
    unknown size was a KeyError, an unknown mode ran as 'off', an empty --concurrency a
    ValueError, and a zero, negative or nan --duration or --warmup measured nothing)."""
    if str(REPO) not in sys.path:  # (run as a script: the checkout's benchmarks package)
        sys.path.insert(0, str(REPO))
    from benchmarks.runner import counts_problem, names_problem, number_problem

    return (names_problem(args.sizes, list(SIZES["cpu"]["rows"]), "--sizes")
            or names_problem(args.modes, list(MODES), "--modes")
            or counts_problem(args.concurrency, "--concurrency")
            or number_problem(args.duration, "--duration")
            or number_problem(args.warmup, "--warmup", zero=True)
            or number_problem(args.client_procs, "--client-procs", zero=True)
            or number_problem(args.batch_delay_us, "--batch-delay-us", zero=True))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=_out_path, help="write the results as JSON here")
    p.add_argument("--concurrency", default="1,8,64,256")
    p.add_argument("--sizes", default="small,large")
    p.add_argument("--modes", default=",".join(MODES), help="batching modes: on, off")
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per point")
    p.add_argument("--client-procs", type=int, default=0,
                   help="load-generator processes (default: 1 on <= 4 cores, else 4)")
    p.add_argument("--batch-delay-us", type=int, default=0,
                   help="the server's batch delay in the 'on' mode")
    p.add_argument("--device", default="auto", help="the server's --device")
    p.add_argument("--device-label", default=None, help="device name written to the JSON")
    p.add_argument("--date", default=None, help="date written to the JSON (default today)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for the server (repeatable)")
    args = p.parse_args(argv)
    if why := _arg_problem(args):
        p.error(why)

    import torch

    # Here, not at the top: the spawned load generators import this module, and stay light.
    from benchmarks.runner import split_names
    from moe_gemm.tuning.table_io import json_line, write_json

    use_cuda = args.device.startswith("cuda") or (args.device == "auto"
                                                  and torch.cuda.is_available())
    kind = "cuda" if use_cuda else "cpu"
    size = SIZES[kind]
    cores = os.cpu_count() or 1
    label = args.device_label or (torch.cuda.get_device_name() if use_cuda
                                  else f"cpu ({cores} cores)")
    procs = args.client_procs or (1 if cores <= 4 else 4)
    levels = [int(c) for c in split_names(args.concurrency)]
    sizes = split_names(args.sizes)
    modes = split_names(args.modes)
    dtype = getattr(torch, size["dtype"])
    E, K, N = size["experts"], size["k"], size["n"]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(E, K, N, generator=gen).to(dtype)
    bodies, refs = {}, {}
    for s in sizes:
        T = size["rows"][s]
        x = torch.randn(T, K, generator=gen).to(dtype)
        counts = torch.bincount(torch.randint(0, E, (T,), generator=gen), minlength=E).int()
        bodies[s] = _st({"x": x, "counts": counts})
        ref = torch.zeros(T, N, dtype=torch.float64)
        start = 0
        for e, c in enumerate(counts.tolist()):
            ref[start:start + c] = x[start:start + c].double() @ w[e].double()
            start += c
        refs[s] = ref

    load_at_start = [round(v, 2) for v in os.getloadavg()]
    log_path = Path(tempfile.gettempdir()) / f"bench_server-{os.getpid()}.log"
    print(f"server log: {log_path}", flush=True)
    results = []
    meta = {}
    for mode in modes:
        flags = ["--device", args.device, *args.server_arg]
        flags += (["--batch-delay-us", str(args.batch_delay_us)] if mode == "on"
                  else ["--no-batching"])
        server = Server(flags, log_path)
        try:
            server.wait_ready()
            status, info = server.get("/v2")
            meta = json.loads(info)
            status, out = server.request("PUT", "/v1/weights/bench", _st({"w": w}))
            assert status in (200, 201), out
            for s in sizes:
                from safetensors.torch import load

                status, out = server.request("POST", "/v1/weights/bench/grouped-mm", bodies[s])
                assert status == 200, out
                y = load(out)["y"].double()
                err = (y - refs[s]).abs().max().item() / refs[s].abs().max().item()
                assert err < (2e-2 if dtype != torch.float32 else 1e-4), err
                path = "/v1/weights/bench/grouped-mm"
                head = _head(path, f"127.0.0.1:{server.port}", len(bodies[s]), None)
                for c in levels:
                    _, m0 = server.get("/metrics")
                    per = [c // procs + (1 if i < c % procs else 0) for i in range(procs)]
                    per = [n for n in per if n]
                    # load processes start in ~1 s (spawn); the window is wall-clock based
                    t_measure = time.time() + (1.0 if len(per) > 1 else 0.0) + args.warmup
                    t_end = t_measure + args.duration
                    jobs = [("127.0.0.1", server.port, head, bodies[s], n, t_measure, t_end)
                            for n in per]
                    if len(jobs) == 1:
                        outs = [_worker(jobs[0])]
                    else:
                        with mp.get_context("spawn").Pool(len(jobs)) as pool:
                            outs = pool.map(_worker, jobs)
                    _, m1 = server.get("/metrics")
                    lat = np.array(sorted(v for o in outs for v in o[0]))
                    errors = sum(o[2] for o in outs)
                    window = max(max(o[1] for o in outs) - t_measure, args.duration)
                    t0, t1 = m0.decode(), m1.decode()
                    launches = (_metric_sum(t1, "moe_gemm_batch_requests_count")
                                - _metric_sum(t0, "moe_gemm_batch_requests_count"))
                    reqs = (_metric_sum(t1, "moe_gemm_batch_requests_sum")
                            - _metric_sum(t0, "moe_gemm_batch_requests_sum"))
                    rows = (_metric_sum(t1, "moe_gemm_batch_rows_sum")
                            - _metric_sum(t0, "moe_gemm_batch_rows_sum"))
                    row = {
                        "batching": mode,
                        "size": s,
                        "rows_per_request": size["rows"][s],
                        "concurrency": c,
                        "requests": int(lat.size),
                        "errors": errors,
                        "rps": round(lat.size / window, 1),
                        "window_s": round(window, 2),
                        "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3)
                        if lat.size else None,
                        "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3)
                        if lat.size else None,
                        "mean_requests_per_launch": round(reqs / launches, 2) if launches
                        else None,
                        "mean_rows_per_launch": round(rows / launches, 1) if launches else None,
                    }
                    results.append(row)
                    print(json_line(row), flush=True)
        finally:
            server.stop()

    doc = {
        "benchmark": "moe-gemm-server load (benchmarks/bench_server.py)",
        "date": args.date or _dt.date.today().isoformat(),
        "device": label,
        "server": {"device": meta.get("device"), "backend": meta.get("backend"),
                   "version": meta.get("version")},
        "host": {"cpu_count": cores, "python": platform.python_version(),
                 "torch": torch.__version__, "platform": platform.platform(),
                 "loadavg_at_start": load_at_start,
                 "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
                 "event_loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"},
        "setup": {
            "weights": {"experts": E, "k": K, "n": N, "dtype": size["dtype"]},
            "rows": {s: size["rows"][s] for s in sizes},
            "duration_s": args.duration, "warmup_s": args.warmup,
            "window": "requests started in [warm-up end, warm-up end + duration]; those still "
                      "in flight at the end are awaited and counted; rps = count / (last "
                      "finish - window start)",
            "client_processes": procs,
            "batching_on": f"--batch-delay-us {args.batch_delay_us}",
            "batching_off": "--no-batching",
            "note": "server and load generator on one machine, 127.0.0.1, safetensors bodies",
        },
        "results": results,
    }
    if args.out:
        write_json(args.out, doc)
    _print_table(doc)


def _print_table(doc: dict) -> None:
    print(f"\nmoe-gemm-server on {doc['device']} ({doc['server']['backend']} backend); "
          f"weights {doc['setup']['weights']}")
    print(f"{'size':<6} {'rows':>5} {'conc':>5} {'batching':>8} {'req/s':>9} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'req/launch':>10} {'errors':>6}")
    for r in sorted(doc["results"], key=lambda r: (r["size"] != "small", r["concurrency"],
                                                   r["batching"] != "on")):
        print(f"{r['size']:<6} {r['rows_per_request']:>5} {r['concurrency']:>5} "
              f"{r['batching']:>8} {r['rps']:>9.1f} {r['p50_ms'] or 0:>8.2f} "
              f"{r['p99_ms'] or 0:>8.2f} {r['mean_requests_per_launch'] or 0:>10.2f} "
              f"{r['errors']:>6}")


if __name__ == "__main__":
    main()
