"""Chaos run against one moe-gemm-server process on this machine: kill -9 under load, restarts,
uploads racing inferences and each other, slow clients. Reports what happened to every request.

    python scripts/chaos.py --duration 20 --kills 2 --json chaos.json

What runs at once, for --duration seconds, against 127.0.0.1 only:
- inference clients: grouped-mm requests with fresh random data, each checked against a
  float64 reference of the weights it must have used; connection errors, 503 and 429 are
  retried (with backoff) until the request's own deadline, as a client library does;
- an uploader: new versions of one weight set, one after another (each PUT retried until
  acknowledged); inferences on that set must match one of its versions;
- a burst of concurrent PUTs of one name now and then: exactly one complete set must win;
- slow clients: a request body trickled over seconds, and a connection that sends half its
  headers and stalls (the server must keep serving everyone else);
- the monkey: kill -9 at even intervals, then an immediate restart. After each restart every
  acknowledged weight set must be served at its last acknowledged version (or a version whose
  upload was in flight at the kill: it may have been stored before the answer was sent).

The report counts requests sent, answered right, refused with a clear status (an HTTP error
with a JSON message), answered wrong and lost (no answer by the deadline); exit status 1 if any
request was lost or wrong or an acknowledged write was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load, save

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # moe_gemm of this checkout, as the server it starts imports
from moe_gemm.tuning.table_io import json_line, write_json  # noqa: E402

ADMIN = "chaos-admin-key"
E, K, N = 4, 32, 16
RETRYABLE = {429, 503}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _body(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.contiguous() for k, v in tensors.items()})


class Server:
    """The server process; restartable on the same port and data directory."""

    def __init__(self, data: Path, port: int, log_path: Path, extra: list[str]) -> None:
        self.data, self.port, self.log_path, self.extra = data, port, log_path, extra
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 90) -> float:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GEMM_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "server"),
                                             env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "moe_gemm_server", "--port", str(self.port),
               "--data-dir", str(self.data), "--admin-key", ADMIN, "--warmup-rows", "1",
               "--max-queue", "64", "--batch-delay-us", "500", "--drain-timeout-s", "5",
               "--log-level", "warning", *self.extra]
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.starts += 1
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"server not ready after {timeout} s")
            time.sleep(0.05)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


@dataclass
class Report:
    sent: int = 0
    answered_right: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # "status: message start" -> n
    wrong: int = 0
    lost: int = 0
    retries: int = 0
    kills: int = 0
    restarts: int = 0
    restart_s: list[float] = field(default_factory=list)
    uploads_acked: int = 0
    contended_bursts: int = 0
    contended_failures: list[str] = field(default_factory=list)
    durability_checks: int = 0
    durability_failures: list[str] = field(default_factory=list)
    slow_clients_right: int = 0
    stalled_connections: int = 0
    samples: list[str] = field(default_factory=list)  # what the wrong and lost ones were
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}
        d = json.loads(json_line(d, default=dict))  # a deep copy, plain dicts
        d["refused"] = dict(self.refused)
        d["refused_total"] = sum(self.refused.values())
        return d


class Chaos:
    def __init__(self, server: Server, args: argparse.Namespace) -> None:
        self.server, self.args = server, args
        self.report = Report()
        self.stop = threading.Event()
        self.rng = random.Random(args.seed)
        self.stable = {f"stable-{i}": torch.randn(E, K, N) for i in range(2)}
        self.churn: list[torch.Tensor] = []  # every version of "churn" ever sent
        self.churn_acked = -1  # index of the last acknowledged version
        self.churn_inflight: int | None = None
        self.state = threading.Lock()
        self.admin = {"Authorization": f"Bearer {ADMIN}"}

    # -- requests with retries ---------------------------------------------------------

    def _send(self, method: str, path: str, content: bytes, deadline: float,
              headers: dict[str, str] | None = None) -> httpx.Response | None:
        """Retry connection errors, 503 and 429 until the deadline; None = no answer."""
        delay = 0.05
        last: httpx.Response | None = None
        while time.monotonic() < deadline:
            try:
                r = httpx.request(method, f"{self.server.url}{path}", content=content,
                                  headers=headers, timeout=max(0.5, deadline - time.monotonic()))
                if r.status_code not in RETRYABLE:
                    return r
                last = r
            except httpx.HTTPError:
                last = None
            self.report.add(retries=1)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
        return last

    def _sample(self, what: str) -> None:
        with self.report.lock:
            if len(self.report.samples) < 20:
                self.report.samples.append(what[:300])

    def _classify(self, r: httpx.Response | None, check, what: str = "") -> None:  # type: ignore[no-untyped-def]
        if r is None:
            self.report.add(lost=1)
            self._sample(f"lost: {what}: no answer by the deadline")
        elif 200 <= r.status_code < 300:
            if check(r):
                self.report.add(answered_right=1)
            else:
                self.report.add(wrong=1)
                self._sample(f"wrong: {what}")
        else:
            try:
                msg = r.json()["error"]
                assert isinstance(msg, str) and msg
            except Exception:  # noqa: BLE001 - an error without a clear message
                self.report.add(lost=1)
                self._sample(f"lost: {what}: {r.status_code} {r.text[:200]!r}")
                return
            with self.report.lock:
                self.report.refused[f"{r.status_code}: {msg[:40]}"] += 1

    def _mm_body(self) -> tuple[bytes, torch.Tensor, torch.Tensor]:
        T = self.rng.randint(1, 16)
        x = torch.randn(T, K)
        counts = torch.bincount(torch.randint(0, E, (T,)), minlength=E)
        return _body({"x": x, "counts": counts}), x, counts

    @staticmethod
    def _matches(r: httpx.Response, x: torch.Tensor, counts: torch.Tensor,
                 candidates: list[torch.Tensor]) -> bool:
        y = load(r.content)["y"].double()
        for w in candidates:
            ref, start = torch.zeros(x.shape[0], N, dtype=torch.float64), 0
            for e, c in enumerate(counts.tolist()):
                ref[start:start + c] = x[start:start + c].double() @ w[e].double()
                start += c
            if torch.allclose(y, ref, atol=1e-4, rtol=1e-4):
                return True
        return False

    # -- workers -------------------------------------------------------------------------

    def inference_client(self) -> None:
        while not self.stop.is_set():
            name = self.rng.choice(["stable-0", "stable-1", "churn"])
            if name == "churn" and self.churn_acked < 0:
                continue
            body, x, counts = self._mm_body()
            self.report.add(sent=1)
            r = self._send("POST", f"/v1/weights/{name}/grouped-mm", body,
                           time.monotonic() + self.args.request_deadline_s)

            def right(resp: httpx.Response) -> bool:
                with self.state:  # any version sent so far (one may have landed meanwhile)
                    candidates = list(self.churn) if name == "churn" else [self.stable[name]]
                return self._matches(resp, x, counts, candidates)

            self._classify(r, right, f"grouped-mm {name}")

    def uploader(self) -> None:
        while not self.stop.is_set():
            w = torch.randn(E, K, N)
            with self.state:
                self.churn.append(w)
                self.churn_inflight = len(self.churn) - 1
            self.report.add(sent=1)
            deadline = time.monotonic() + self.args.request_deadline_s
            r = self._send("PUT", "/v1/weights/churn", _body({"w": w}), deadline, self.admin)
            ok = r is not None and r.status_code in (200, 201)
            with self.state:
                if ok:
                    self.churn_acked = self.churn_inflight  # type: ignore[assignment]
                self.churn_inflight = None
            self._classify(r, lambda resp: True, "PUT churn")
            if ok:
                self.report.add(uploads_acked=1)
            time.sleep(0.2)

    def contended_burst(self, n: int = 4) -> None:
        """n PUTs of one name at once: one complete set must end up served and stored."""
        versions = [torch.randn(E, K, N) for _ in range(n)]
        results: list[int | None] = [None] * n
        barrier = threading.Barrier(n)

        def put(i: int) -> None:
            barrier.wait()
            r = self._send("PUT", "/v1/weights/contended", _body({"w": versions[i]}),
                           time.monotonic() + self.args.request_deadline_s, self.admin)
            results[i] = None if r is None else r.status_code
            self._classify(r, lambda resp: True, "PUT contended")

        self.report.add(sent=n, contended_bursts=1)
        threads = [threading.Thread(target=put, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not all(s in (200, 201) for s in results):
            return  # a kill interrupted the burst; the requests were classified above
        body, x, counts = self._mm_body()
        r = self._send("POST", "/v1/weights/contended/grouped-mm", body,
                       time.monotonic() + self.args.request_deadline_s)
        if r is None or r.status_code != 200:
            return
        served = [i for i, v in enumerate(versions) if self._matches(r, x, counts, [v])]
        stored = load((self.server.data / "contended.safetensors").read_bytes())["w"]
        on_disk = [i for i, v in enumerate(versions) if torch.equal(stored, v)]
        if len(served) != 1 or served != on_disk:
            self.report.contended_failures.append(f"served {served}, on disk {on_disk}")

    def slow_client(self) -> None:
        """A body trickled in 8 pieces over ~1.6 s; must be answered right like any other."""
        while not self.stop.is_set():
            body, x, counts = self._mm_body()
            self.report.add(sent=1)
            deadline = time.monotonic() + self.args.request_deadline_s
            answered = False
            while not answered and time.monotonic() < deadline:
                try:
                    with socket.create_connection(("127.0.0.1", self.server.port), 5) as s:
                        s.sendall((f"POST /v1/weights/stable-0/grouped-mm HTTP/1.1\r\nHost: x\r\n"
                                   f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                                   ).encode())
                        step = -(-len(body) // 8)
                        for i in range(0, len(body), step):
                            s.sendall(body[i:i + step])
                            time.sleep(0.2)
                        s.settimeout(10)
                        data = b""
                        while chunk := s.recv(65536):
                            data += chunk
                    head, _, payload = data.partition(b"\r\n\r\n")
                    status = int(head.split()[1])
                    if status == 200 and self._matches_raw(payload, x, counts):
                        self.report.add(answered_right=1, slow_clients_right=1)
                        answered = True
                    elif status not in RETRYABLE:
                        self.report.add(wrong=1)
                        self._sample(f"wrong: slow client: {status} {payload[:200]!r}")
                        answered = True
                except (OSError, ValueError, IndexError):
                    self.report.add(retries=1)
                    time.sleep(0.2)
            if not answered:
                self.report.add(lost=1)
                self._sample("lost: slow client: no answer by the deadline")

    def _matches_raw(self, payload: bytes, x: torch.Tensor, counts: torch.Tensor) -> bool:
        return self._matches(httpx.Response(200, content=payload), x, counts,
                             [self.stable["stable-0"]])

    def stalled_connection(self) -> None:
        """Half a request line's headers, then nothing (a slowloris): the server must not
        wait on it with anyone else's work."""
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.server.port), 5) as s:
                    s.sendall(b"POST /v1/weights/stable-0/grouped-mm HTTP/1.1\r\nHost: x\r\n")
                    self.report.add(stalled_connections=1)
                    self.stop.wait(3.0)
            except OSError:
                time.sleep(0.2)

    # -- the monkey ------------------------------------------------------------------------

    def check_durability(self, allowed_churn: set[int], sent_before_kill: int) -> None:
        """After a restart: the stable sets as uploaded; "churn" at its last acknowledged
        version, one in flight at the kill, or one sent since (the uploader carries on)."""
        body, x, counts = self._mm_body()
        for name, w in self.stable.items():
            r = self._send("POST", f"/v1/weights/{name}/grouped-mm", body,
                           time.monotonic() + 10)
            self.report.add(durability_checks=1)
            if r is None or r.status_code != 200 or not self._matches(r, x, counts, [w]):
                self.report.durability_failures.append(
                    f"{name}: {None if r is None else r.status_code} after restart")
        if allowed_churn:
            r = self._send("POST", "/v1/weights/churn/grouped-mm", body, time.monotonic() + 10)
            self.report.add(durability_checks=1)
            with self.state:
                allowed = [self.churn[i] for i in sorted(allowed_churn)]
                allowed += self.churn[sent_before_kill:]
            if r is None or r.status_code != 200 or not self._matches(r, x, counts, allowed):
                self.report.durability_failures.append(
                    f"churn: not the last acknowledged version after restart "
                    f"({None if r is None else r.status_code})")

    def monkey(self) -> None:
        interval = self.args.duration / (self.args.kills + 1)
        for _ in range(self.args.kills):
            if self.stop.wait(interval):
                return
            with self.state:
                # the last acknowledged version, and one whose upload may have been stored
                # but not yet answered
                allowed = {i for i in (self.churn_acked, self.churn_inflight)
                           if i is not None and i >= 0}
                sent = len(self.churn)
                self.server.kill9()
            self.report.add(kills=1)
            self.report.restart_s.append(round(self.server.start(), 2))
            self.report.add(restarts=1)
            self.check_durability(allowed, sent)

    def run(self) -> Report:
        for name, w in self.stable.items():
            r = self._send("PUT", f"/v1/weights/{name}", _body({"w": w}),
                           time.monotonic() + 30, self.admin)
            assert r is not None and r.status_code in (200, 201), r
        workers = [threading.Thread(target=self.inference_client, daemon=True)
                   for _ in range(self.args.clients)]
        workers += [threading.Thread(target=self.uploader, daemon=True),
                    threading.Thread(target=self.slow_client, daemon=True),
                    threading.Thread(target=self.stalled_connection, daemon=True)]
        monkey = threading.Thread(target=self.monkey, daemon=True)
        for t in workers:
            t.start()
        monkey.start()
        end = time.monotonic() + self.args.duration
        while time.monotonic() < end:
            self.contended_burst()
            self.stop.wait(max(0.0, min(self.args.duration / 4, end - time.monotonic())))
        monkey.join()
        self.stop.set()
        for t in workers:
            t.join(self.args.request_deadline_s + 15)
        return self.report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    p.add_argument("--kills", type=int, default=2, help="kill -9 + restart cycles")
    p.add_argument("--clients", type=int, default=3, help="inference client threads")
    p.add_argument("--request-deadline-s", type=float, default=30.0,
                   help="how long a request is retried before it counts as lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="data dir and log (default: tmp)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    import tempfile

    work = args.workdir or Path(tempfile.mkdtemp(prefix="moe-gemm-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    server = Server(work / "data", _free_port(), work / "server.log", [])
    t0 = time.monotonic()
    server.start()
    try:
        report = Chaos(server, args).run()
    finally:
        code = server.stop()
    d = report.as_dict()
    d["final_exit_code"] = code
    d["elapsed_s"] = round(time.monotonic() - t0, 1)
    d["server_log"] = str(server.log_path)
    print(f"chaos: {d['sent']} requests sent, {d['answered_right']} answered right, "
          f"{d['refused_total']} refused with a clear status, {d['wrong']} wrong, "
          f"{d['lost']} lost; {d['kills']} kill -9 and {d['restarts']} restarts "
          f"({', '.join(f'{s} s' for s in d['restart_s'])}), {d['uploads_acked']} uploads "
          f"acknowledged, {d['durability_checks']} durability checks "
          f"({len(d['durability_failures'])} failed), {d['contended_bursts']} concurrent-PUT "
          f"bursts ({len(d['contended_failures'])} failed), {d['slow_clients_right']} slow "
          f"clients answered right, {d['retries']} retries")
    if d["refused"]:
        print("refused:", json_line(d["refused"]))
    for line in d["samples"] + d["durability_failures"] + d["contended_failures"]:
        print("  ", line)
    if args.json:
        write_json(args.json, d)
    ok = (d["lost"] == 0 and d["wrong"] == 0 and not d["durability_failures"]
          and not d["contended_failures"] and code == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
