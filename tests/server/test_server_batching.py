"""Dynamic batching and admission control against real servers (CPU, torch backend).

Exactness of merged answers: with the torch backend on the CPU, a merged launch computes an
expert's rows with one BLAS call over more rows than the solo run did, and CPU BLAS does not
promise row-invariant results (a single row goes through gemv, and the K blocking changes with
M), so bitwise equality with random floats is not guaranteed there. With integer-valued data
every summation order gives the exact same sum, so there the merged answer must be bitwise the
solo answer: any misplaced row, wrong expert or mixed-up request shows. Random float data is
checked to rounding. (On the GPU the cute kernel computes each row in a fixed K order, and
tests/test_engine.py checks bitwise equality there with random data.)
"""

from __future__ import annotations

import contextlib
import gc
import json
import socket
import threading
import time

import httpx
import pytest
import torch
from server_testutils import (
    LiveServer,
    assert_close_to_ref,
    metric,
    mm_ref,
    random_counts,
    st_body,
    st_load,
)

E, K, N = 5, 64, 48
DELAY_S = 0.15
# Long against the 100-200 ms request timeouts below, so that a starved CI machine (2 cores,
# server and test in one box) cannot reach the end of the batch window before a timeout fires.
SLOW_DELAY_S = 4.0
# One pooled client for the module (httpx clients are thread-safe; building one per request
# would cost an SSL context each time).
HTTP = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=64))


@pytest.fixture(scope="module", autouse=True)
def _close_http():
    """Close HTTP once the module's tests are done: its pool keeps the last keep-alive
    connection after the servers stop, and nothing else closes that socket before interpreter
    exit (an "unclosed socket" ResourceWarning at the end of the full run)."""
    yield
    HTTP.close()


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory):
    """Merging on: the oldest request waits up to 150 ms for others to join its launch; a
    launch holds at most 2048 rows, so a "heavy" request starts at once, alone."""
    server = LiveServer(tmp_path_factory.mktemp("batching") / "data",
                        "--batch-delay-us", str(int(DELAY_S * 1e6)), "--max-batch-rows", "2048",
                        "--log-level", "warning")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """A 4 s batch delay and a queue of 3: requests sit in the queue long enough to be
    refused, timed out or abandoned while queued."""
    server = LiveServer(tmp_path_factory.mktemp("slow") / "data",
                        "--batch-delay-us", str(int(SLOW_DELAY_S * 1e6)), "--max-queue", "3",
                        "--log-level", "warning")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _put(url: str, name: str, w: torch.Tensor) -> None:
    r = HTTP.put(f"{url}/v1/weights/{name}", content=st_body({"w": w}))
    assert r.status_code in (200, 201), r.text


def _mm(url: str, name: str, x: torch.Tensor, c: torch.Tensor, **headers: str
        ) -> httpx.Response:
    return HTTP.post(f"{url}/v1/weights/{name}/grouped-mm",
                     content=st_body({"x": x, "counts": c}), headers=headers)


def _concurrently(fn, args_list: list[tuple]) -> list:
    """Run fn(*args) for every args in threads started together; results in order."""
    results: list = [None] * len(args_list)
    start = threading.Barrier(len(args_list))

    def run(i: int) -> None:
        start.wait(10)
        results[i] = fn(*args_list[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return results


def _metrics(url: str) -> str:
    return HTTP.get(f"{url}/metrics").text


# --------------------------------------------------------------------------- merging


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_launch_answers_equal_solo_answers(batching_server, dtype):
    url = batching_server.url
    gen = torch.Generator().manual_seed(31)
    name = f"merge-{str(dtype)[6:]}"
    w = torch.randint(-4, 5, (E, K, N), generator=gen).to(dtype)
    _put(url, name, w)
    reqs = []
    for i, T in enumerate((1, 0, 9, 23, 2, 40, 5, 17)):
        x = torch.randint(-4, 5, (T, K), generator=gen).to(dtype)
        reqs.append((url, name, x, random_counts(T, E, gen, empty=i % E)))
    before = _metrics(url)
    answers = _concurrently(_mm, reqs)
    after = _metrics(url)
    launches = (metric(after, "moe_gemm_batch_requests_count", kind="mm")
                - metric(before, "moe_gemm_batch_requests_count", kind="mm"))
    merged_requests = (metric(after, "moe_gemm_batch_requests_sum", kind="mm")
                       - metric(before, "moe_gemm_batch_requests_sum", kind="mm"))
    singles = (metric(after, "moe_gemm_batch_requests_bucket", kind="mm", le="1.0")
               - metric(before, "moe_gemm_batch_requests_bucket", kind="mm", le="1.0"))
    assert merged_requests == len(reqs)
    assert launches < len(reqs), "no request was merged with another"
    assert singles < launches or launches == 1
    rows = (metric(after, "moe_gemm_batch_rows_sum", kind="mm")
            - metric(before, "moe_gemm_batch_rows_sum", kind="mm"))
    assert rows == sum(x.shape[0] for _, _, x, _ in reqs)
    for (_, _, x, c), r in zip(reqs, answers):
        assert r.status_code == 200, r.text
        merged = st_load(r.content)["y"]
        solo_r = _mm(url, name, x, c)
        assert solo_r.status_code == 200
        solo = st_load(solo_r.content)["y"]
        assert merged.dtype == dtype and merged.shape == (x.shape[0], N)
        assert torch.equal(merged, solo)
        assert torch.equal(merged, mm_ref(x, w, c).to(dtype))  # integers: exact


def test_merged_launch_random_data(batching_server):
    url = batching_server.url
    gen = torch.Generator().manual_seed(32)
    w = torch.randn(E, K, N, generator=gen)
    _put(url, "merge-rnd", w)
    reqs = [(url, "merge-rnd", torch.randn(T, K, generator=gen), random_counts(T, E, gen))
            for T in (3, 30, 1, 12, 7, 60)]
    for (_, _, x, c), r in zip(reqs, _concurrently(_mm, reqs)):
        assert r.status_code == 200, r.text
        merged = st_load(r.content)["y"]
        solo = st_load(_mm(url, "merge-rnd", x, c).content)["y"]
        ref = mm_ref(x, w, c)
        torch.testing.assert_close(merged, solo, atol=1e-4, rtol=1e-5)
        assert_close_to_ref(merged, ref, torch.float32)


def test_grouped_gemm_requests_merge_exactly(batching_server):
    """Ad-hoc problems of concurrent requests share one launch; each problem is computed on
    its own, so even random data must match the solo answer bit for bit."""
    url = batching_server.url
    gen = torch.Generator().manual_seed(33)
    bodies = []
    for i in range(6):
        body = {}
        for p in range(i % 3 + 1):
            m, k, n = (int(v) for v in torch.randint(1, 40, (3,), generator=gen))
            body[f"a.{p}"] = torch.randn(m, k, generator=gen)
            body[f"b.{p}"] = torch.randn(k, n, generator=gen)
        bodies.append(body)

    def post(body: dict) -> httpx.Response:
        return HTTP.post(f"{url}/v1/grouped-gemm", content=st_body(body))

    before = _metrics(url)
    answers = _concurrently(post, [(b,) for b in bodies])
    after = _metrics(url)
    launches = (metric(after, "moe_gemm_batch_requests_count", kind="gemm")
                - metric(before, "moe_gemm_batch_requests_count", kind="gemm"))
    assert 1 <= launches < len(bodies)
    for body, r in zip(bodies, answers):
        assert r.status_code == 200, r.text
        d = st_load(r.content)
        solo = st_load(post(body).content)
        assert sorted(d) == sorted(solo)
        for key in d:
            assert torch.equal(d[key], solo[key])
            i = key.split(".")[1]
            assert_close_to_ref(d[key], body[f"a.{i}"].double() @ body[f"b.{i}"].double(),
                                torch.float32)


# --------------------------------------------------------------------------- priorities, timeouts


@contextlib.contextmanager
def _no_client_gc():
    """The client's own garbage-collection pauses (a full collection of this test process's
    heap can take longer than the deadlines timed here) kept out of a timed request."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def heavy(batching_server):
    """A set whose requests spend most of their time computing on the CPU: 2 x 2112 x 2048 x
    4096 FLOPs against 17 MB up and 35 MB down, so a deadline at a third of a request's time
    falls while it computes, not while it uploads. (2112 rows: over the server's 2048-row
    launch limit, so it starts at once, alone, without waiting out the batch delay.)"""
    gen = torch.Generator().manual_seed(34)
    _put(batching_server.url, "heavy", torch.randn(1, 2048, 4096, generator=gen))
    x = torch.randn(2112, 2048, generator=gen)
    c = torch.tensor([2112], dtype=torch.int32)
    assert _mm(batching_server.url, "heavy", x, c).status_code == 200  # warm
    with _no_client_gc():
        t0 = time.monotonic()
        assert _mm(batching_server.url, "heavy", x, c).status_code == 200
        t_solo = time.monotonic() - t0
    return x, c, t_solo


def test_priority_orders_the_queue(slow_server):
    """Within the batch delay (4 s on this server) a low-priority request queues first and a
    high-priority one after it: the high one must be launched first. The launch order is read
    from the server's per-model statistics while both are in flight (each launch of ~17 GFLOP
    takes a while on a CPU): the high set's execution count must move first. (Comparing when
    the answers arrive raced on the 2-core CI machine: the first answer's 16 MB still being
    encoded and decoded while the second launch computed, the second answer came back first.
    Queuing both behind a running launch raced too: the launch could end before the second
    request arrived.)"""
    url = slow_server.url
    gen = torch.Generator().manual_seed(35)
    _put(url, "prio-low", torch.randn(1, 2048, 2048, generator=gen))
    _put(url, "prio-high", torch.randn(1, 2048, 2048, generator=gen))
    x_low = torch.randn(2048, 2048, generator=gen)
    x_high = torch.randn(2048, 2048, generator=gen)
    done: set[str] = set()

    def send(label: str, name: str, xx, prio: str) -> None:
        cc = torch.tensor([xx.shape[0]], dtype=torch.int32)
        r = _mm(url, name, xx, cc, **{"X-Priority": prio})
        assert r.status_code == 200, r.text
        done.add(label)

    def wait_for(family: str, value: float) -> None:
        deadline = time.monotonic() + 20
        while metric(_metrics(url), family) < value:
            assert time.monotonic() < deadline, f"{family} never reached {value}"
            time.sleep(0.005)

    wait_for("moe_gemm_queued_requests", 0)
    assert metric(_metrics(url), "moe_gemm_queued_requests") == 0
    t0 = time.monotonic()
    low = threading.Thread(target=send, args=("low", "prio-low", x_low, "7"))
    low.start()
    wait_for("moe_gemm_queued_requests", 1)  # low is queued first ...
    high = threading.Thread(target=send, args=("high", "prio-high", x_high, "1"))
    high.start()  # ... high arrives later but must run first
    wait_for("moe_gemm_queued_requests", 2)
    assert time.monotonic() - t0 < SLOW_DELAY_S, "both must be queued within the batch delay"
    def executed(name: str) -> tuple[int, int]:
        r = HTTP.get(f"{url}/v2/models/{name}/stats")
        assert r.status_code == 200, r.text
        stats = r.json()["model_stats"][0]
        return stats["execution_count"], stats["last_inference"]

    deadline = time.monotonic() + 60
    while True:  # the first launch to finish is seen before or together with the second
        (n_high, at_high), (n_low, at_low) = executed("prio-high"), executed("prio-low")
        if n_high or n_low:
            break
        assert time.monotonic() < deadline, "neither request was launched"
        time.sleep(0.002)
    assert n_high == 1, "the high-priority request must be launched first"
    if n_low:  # both ended between two polls (a fast device): the launch end times decide
        assert at_high <= at_low
    for t in (low, high):
        t.join(60)
    assert set(done) == {"low", "high"}


def test_timeout_during_compute_is_never_answered_late(batching_server, heavy):
    url = batching_server.url
    x_big, c_big, t_solo = heavy
    timeout = 0.3 * t_solo  # expires while the launch computes (or earlier on a fast machine)
    with _no_client_gc():
        t0 = time.monotonic()
        r = _mm(url, "heavy", x_big, c_big, **{"X-Timeout-Us": str(int(timeout * 1e6))})
        elapsed = time.monotonic() - t0
    assert r.status_code == 504, r.text
    assert "timeout" in r.json()["error"]
    # answered at its deadline, not when the launch finished
    assert elapsed < 0.75 * t_solo, (elapsed, t_solo)
    assert metric(_metrics(url), "moe_gemm_rejections_total", reason="timeout") >= 1
    # the launch it was part of finishes in the background; the server carries on
    r = _mm(url, "heavy", x_big[:8], torch.tensor([8], dtype=torch.int32))
    assert r.status_code == 200
    assert HTTP.get(f"{url}/v2/health/ready").status_code == 200


def test_bad_admission_headers(batching_server):
    url = batching_server.url
    x = torch.randn(1, K)
    c = torch.tensor([1] + [0] * (E - 1), dtype=torch.int32)
    _put(url, "hdr", torch.randn(E, K, N))
    for h in ({"X-Timeout-Us": "soon"}, {"X-Timeout-Us": "-5"}, {"X-Priority": "high"}):
        r = _mm(url, "hdr", x, c, **h)
        assert r.status_code == 400 and "error" in r.json()


# --------------------------------------------------------------------------- admission


def test_a_request_timeout_shortens_the_default_but_never_lengthens_it(tmp_path):
    """--default-timeout-us is the operator's bound: as Triton's allow_timeout_override says,
    a request may set a shorter timeout, while a longer one (or one past a year, which alone
    means none) keeps the default."""
    server = LiveServer(tmp_path / "data", "--batch-delay-us", str(int(SLOW_DELAY_S * 1e6)),
                        "--default-timeout-us", "600000", "--log-level", "warning")
    try:
        server.start()
        url = server.url
        _put(url, "d", torch.randn(2, 8, 4))
        x = torch.randn(2, 8)
        c = torch.tensor([1, 1], dtype=torch.int32)
        for headers, low, high in (({}, 0.59, 2.5), ({"X-Timeout-Us": "150000"}, 0.14, 0.55),
                                   ({"X-Timeout-Us": "30000000"}, 0.59, 2.5)):
            t0 = time.monotonic()
            r = _mm(url, "d", x, c, **headers)
            elapsed = time.monotonic() - t0
            assert r.status_code == 504 and "timeout" in r.json()["error"], headers
            assert low <= elapsed < high, (headers, elapsed)
        body = {"inputs": [
            {"name": "x", "shape": [2, 8], "datatype": "FP32", "data": x.flatten().tolist()},
            {"name": "counts", "shape": [2], "datatype": "INT32", "data": c.tolist()}],
            "parameters": {"timeout": 10**18 - 1}}  # (the largest taken, as X-Timeout-Us)
        t0 = time.monotonic()
        r = HTTP.post(f"{url}/v2/models/d/infer", json=body)
        assert r.status_code == 504 and 0.59 <= time.monotonic() - t0 < 2.5
        # A v2 body that stalls before its parameters.timeout could be read: the default
        # bounds it.
        status, elapsed = _stalled_post(url, "/v2/models/d/infer", json.dumps(body).encode(),
                                        {"Content-Type": "application/json"})
        assert status == 504 and 0.59 <= elapsed < 3.0, (status, elapsed)
    finally:
        server.stop()


def test_full_queue_gives_429(slow_server):
    url = slow_server.url
    w = torch.randn(2, 8, 4)
    _put(url, "q", w)
    x = torch.randn(2, 8)
    c = torch.tensor([1, 1], dtype=torch.int32)
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(_mm(url, "q", x, c)))
               for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while metric(_metrics(url), "moe_gemm_queued_requests") < 3:
        assert time.monotonic() < deadline, "requests did not queue"
        time.sleep(0.01)
    r = _mm(url, "q", x, c)
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1 and "queue full" in r.json()["error"]
    for t in threads:
        t.join(30)
    assert [res.status_code for res in results] == [200, 200, 200]
    for res in results:
        assert_close_to_ref(st_load(res.content)["y"], mm_ref(x, w, c), torch.float32)
    assert metric(_metrics(url), "moe_gemm_rejections_total", reason="queue_full") >= 1


def test_queued_timeout_answers_504_at_the_deadline(slow_server):
    url = slow_server.url
    _put(url, "t", torch.randn(2, 8, 4))
    x = torch.randn(2, 8)
    c = torch.tensor([1, 1], dtype=torch.int32)
    before = _metrics(url)
    t0 = time.monotonic()
    r = _mm(url, "t", x, c, **{"X-Timeout-Us": "200000"})
    elapsed = time.monotonic() - t0
    assert r.status_code == 504 and "timeout" in r.json()["error"]
    assert 0.19 <= elapsed < SLOW_DELAY_S - 0.5, elapsed  # the batch delay had not run out
    # the v2 parameter works the same way
    body = {"inputs": [
        {"name": "x", "shape": [2, 8], "datatype": "FP32", "data": x.flatten().tolist()},
        {"name": "counts", "shape": [2], "datatype": "INT32", "data": c.tolist()}],
        "parameters": {"timeout": 100000}}
    t0 = time.monotonic()
    r = HTTP.post(f"{url}/v2/models/t/infer", json=body)
    assert r.status_code == 504 and time.monotonic() - t0 < SLOW_DELAY_S - 0.5
    # the dropped jobs never run: no launch happens for them
    time.sleep(SLOW_DELAY_S + 0.1)
    after = _metrics(url)
    assert metric(after, "moe_gemm_batch_requests_sum", kind="mm") == metric(
        before, "moe_gemm_batch_requests_sum", kind="mm")
    assert (metric(after, "moe_gemm_rejections_total", reason="timeout")
            - metric(before, "moe_gemm_rejections_total", reason="timeout")) == 2


def _stalled_post(url: str, path: str, body: bytes, headers: dict[str, str]
                  ) -> tuple[int, float]:
    """POST whose body stops after its first 10 bytes (the rest never comes): the status of
    the answer and the seconds it took."""
    host, port = url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        t0 = time.monotonic()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{head}Content-Length: "
                     f"{len(body)}\r\n\r\n".encode() + body[:10])
        answer = sock.recv(4096)
        elapsed = time.monotonic() - t0
    return int(answer.split(b" ", 2)[1]), elapsed


@pytest.mark.parametrize("form", ["grouped-mm", "grouped-gemm", "json"])
def test_timeout_while_the_body_arrives_answers_504_at_the_deadline(slow_server, form):
    """The timeout covers the request's whole life, its body's arrival too: a body that
    stalls is answered 504 at the deadline, not once its last byte comes (nor with a 408 at
    --body-timeout-s, 60 s)."""
    url = slow_server.url
    _put(url, "b", torch.randn(2, 8, 4))
    if form == "grouped-gemm":
        path = "/v1/grouped-gemm"
        body = st_body({"a.0": torch.randn(3, 8), "b.0": torch.randn(8, 4)})
        ctype = "application/octet-stream"
    else:
        path = "/v1/weights/b/grouped-mm"
        if form == "json":
            body, ctype = b'{"x": [[1, 2, 3, 4, 5, 6, 7, 8]], "counts": [1, 0]}', "application/json"
        else:
            body = st_body({"x": torch.randn(2, 8), "counts": torch.tensor([1, 1], dtype=torch.int32)})
            ctype = "application/octet-stream"
    before = metric(_metrics(url), "moe_gemm_rejections_total", reason="timeout")
    status, elapsed = _stalled_post(url, path, body, {"Content-Type": ctype,
                                                      "X-Timeout-Us": "300000"})
    assert status == 504 and 0.29 <= elapsed < 3.0, (status, elapsed)
    assert metric(_metrics(url), "moe_gemm_rejections_total", reason="timeout") == before + 1
    assert HTTP.get(f"{url}/v2/health/ready").status_code == 200


def test_disconnect_drops_queued_work(slow_server):
    url = slow_server.url
    _put(url, "d", torch.randn(2, 8, 4))
    body = st_body({"x": torch.randn(2, 8), "counts": torch.tensor([1, 1], dtype=torch.int32)})
    before = _metrics(url)
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = (f"POST /v1/weights/d/grouped-mm HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n")
    sock.sendall(head.encode() + body)
    deadline = time.monotonic() + 10
    while metric(_metrics(url), "moe_gemm_queued_requests") < 1:
        assert time.monotonic() < deadline, "request did not queue"
        time.sleep(0.01)
    sock.close()
    deadline = time.monotonic() + 5
    while True:
        m = _metrics(url)
        if (metric(m, "moe_gemm_rejections_total", reason="disconnected")
                - metric(before, "moe_gemm_rejections_total", reason="disconnected")) == 1:
            break
        assert time.monotonic() < deadline, "the disconnect was not noticed"
        time.sleep(0.01)
    assert metric(m, "moe_gemm_queued_requests") == 0
    time.sleep(SLOW_DELAY_S + 0.1)  # past the batch delay: the dropped job never launched
    assert metric(_metrics(url), "moe_gemm_batch_requests_sum", kind="mm") == metric(
        before, "moe_gemm_batch_requests_sum", kind="mm")
    assert HTTP.get(f"{url}/v2/health/ready").status_code == 200
