"""The moe-gemm-client command line, over a mock transport (and once as a real process)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
import safetensors.numpy
from moe_client_testutils import ContractHandler, grouped_mm_ref, make_client, sequence

from moe_gemm_client import cli
from moe_gemm_client._tensors import BFLOAT16, decode_safetensors, encode_safetensors


@pytest.fixture
def server(monkeypatch):
    """Route the CLI's client to an in-memory ContractHandler; returns the handler."""
    handler = ContractHandler()
    made = []

    def factory(args):
        client = make_client(handler, api_key=args.api_key, max_retries=args.max_retries)
        made.append(client)
        return client

    monkeypatch.setattr(cli, "_make_client", factory)
    handler.made = made
    return handler


def test_health_ready_list_info_delete(server, capsys, rng):
    assert cli.main(["health"]) == 0
    assert json.loads(capsys.readouterr().out) == {"live": True}
    assert cli.main(["ready"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ready": True}
    server.weights["alpha"] = (rng.standard_normal((2, 3, 4)).astype(np.float32), "w")
    server.weights["beta"] = (rng.standard_normal((8, 16, 4)).astype(BFLOAT16), "w_t")
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "E", "K", "N", "DTYPE", "LAYOUT", "MiB"]
    assert lines[2].split()[:6] == ["beta", "8", "16", "4", "bfloat16", "w_t"]
    assert cli.main(["list", "--json"]) == 0
    assert [w["name"] for w in json.loads(capsys.readouterr().out)["weights"]] == ["alpha", "beta"]
    assert cli.main(["info", "alpha"]) == 0
    assert json.loads(capsys.readouterr().out)["k"] == 3
    assert cli.main(["delete", "alpha"]) == 0
    assert json.loads(capsys.readouterr().out) == {"deleted": "alpha"}
    assert "alpha" not in server.weights
    assert all(c.is_closed or not c._owns_http for c in server.made)


def test_list_shows_the_sets_not_loaded(server, capsys, rng):
    server.weights["alpha"] = (rng.standard_normal((2, 3, 4)).astype(np.float32), "w")
    assert cli.main(["list"]) == 0
    assert "not loaded" not in capsys.readouterr().out
    server.not_loaded = [{"name": "huge", "status": 507, "error": "needs 9 GiB, 1 GiB free"}]
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "alpha"
    at = lines.index("not loaded:")
    assert lines[at + 1].split() == ["NAME", "STATUS", "ERROR"]
    assert lines[at + 2].split() == ["huge", "507", "needs", "9", "GiB,", "1", "GiB", "free"]
    assert cli.main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["not_loaded"] == server.not_loaded
    assert [w["name"] for w in listed["weights"]] == ["alpha"]


def test_api_key_flag_is_sent(server, capsys):
    assert cli.main(["--api-key", "k1", "list"]) == 0
    assert server.seen[-1].headers["Authorization"] == "Bearer k1"


def test_errors_have_exit_codes(server, capsys, monkeypatch):
    assert cli.main(["info", "missing"]) == 1
    err = capsys.readouterr().err
    assert "404" in err and "missing" in err
    assert cli.main(["info", "../x"]) == 2
    assert "A-Za-z0-9" in capsys.readouterr().err
    handler, _ = sequence(httpx.ConnectError("refused"))
    monkeypatch.setattr(cli, "_make_client", lambda args: make_client(handler, max_retries=0))
    assert cli.main(["health"]) == 3
    assert "cannot reach" in capsys.readouterr().err
    handler, _ = sequence(httpx.Response(503, json={"ready": False}))
    monkeypatch.setattr(cli, "_make_client", lambda args: make_client(handler))
    assert cli.main(["ready"]) == 1
    assert json.loads(capsys.readouterr().out) == {"ready": False}


def test_bad_url_is_a_usage_error(capsys):
    assert cli.main(["--url", "nonsense://x", "health"]) == 2
    assert "http" in capsys.readouterr().err


def test_upload_with_progress(server, capsys, rng, tmp_path):
    w = rng.standard_normal((4, 8, 16)).astype(np.float32)
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": w}, str(path))
    assert cli.main(["upload", "up", str(path), "--progress"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["experts"] == 4
    assert "upload up" in err and "100.0%" in err and err.endswith("\n")
    np.testing.assert_array_equal(server.weights["up"][0], w)
    # a named tensor uploaded transposed, without a bar
    safetensors.numpy.save_file({"proj": w, "other": w[0]}, str(path))
    assert cli.main(["upload", "t", str(path), "--tensor", "proj", "--layout", "w_t",
                     "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["layout"] == "w_t" and err == ""
    assert cli.main(["upload", "t", str(path)]) == 2
    assert "name the tensor" in capsys.readouterr().err
    assert cli.main(["upload", "t", str(tmp_path / "none.safetensors")]) == 2


def test_progress_bar_draws_and_finishes():
    stream = io.StringIO()
    bar = cli.ProgressBar("upload x", stream=stream, width=10)
    bar(0, 4 << 20)
    bar(1 << 20, 4 << 20)  # throttled: within 0.1 s of the first draw
    bar(4 << 20, 4 << 20)
    bar(4 << 20, 4 << 20)  # already finished: nothing more
    text = stream.getvalue()
    assert text.count("\n") == 1 and "[##########] 100.0%" in text and "4.0/4.0 MiB" in text
    assert "[..........]   0.0%" in text


@pytest.mark.parametrize("fmt", ["npy", "safetensors"])
def test_grouped_mm_files(server, capsys, rng, tmp_path, fmt):
    w = rng.standard_normal((3, 8, 5)).astype(np.float32)
    server.weights["l0"] = (w, "w")
    x = rng.standard_normal((6, 8)).astype(np.float32)
    counts = np.array([2, 0, 4], np.int64)
    if fmt == "npy":
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "c.npy", counts)
        args = ["--x", str(tmp_path / "x.npy"), "--counts", str(tmp_path / "c.npy")]
    else:
        safetensors.numpy.save_file({"x": x, "counts": counts}, str(tmp_path / "in.safetensors"))
        args = ["--x", str(tmp_path / "in.safetensors"), "--counts",
                str(tmp_path / "in.safetensors")]
    out_path = tmp_path / f"y.{fmt}"
    assert cli.main(["grouped-mm", "l0", *args, "--out", str(out_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["shape"] == [6, 5] and summary["request_id"]
    y = np.load(out_path) if fmt == "npy" else safetensors.numpy.load_file(str(out_path))["y"]
    np.testing.assert_allclose(y, grouped_mm_ref(x, w, counts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["3,,5", "3,5,", ",3,5", "", " "])
def test_inline_counts_with_an_empty_field_are_refused(server, capsys, rng, tmp_path, spec):
    """"3,,5" was read as [3, 5]: against a set of E = 2 a typo became another routing, answered
    with no word of the missing value. An empty field is a usage error, nothing is sent."""
    server.weights["e2"] = (rng.standard_normal((2, 4, 3)).astype(np.float32), "w")
    np.save(tmp_path / "x.npy", rng.standard_normal((8, 4)).astype(np.float32))
    sent = len(server.seen)
    for flag in ("--counts", "--offs"):
        assert cli.main(["grouped-mm", "e2", "--x", str(tmp_path / "x.npy"), flag, spec,
                         "--out", str(tmp_path / "y.npy")]) == 2
        assert "comma-separated ints" in capsys.readouterr().err
    assert len(server.seen) == sent
    assert not (tmp_path / "y.npy").exists()


def test_grouped_mm_inline_offs_and_bf16_npy(server, capsys, rng, tmp_path):
    w = rng.standard_normal((2, 4, 3)).astype(BFLOAT16)
    server.weights["b"] = (w, "w")
    x = rng.standard_normal((5, 4)).astype(BFLOAT16)
    np.save(tmp_path / "x.npy", x)  # numpy stores bfloat16 as V2
    assert cli.main(["grouped-mm", "b", "--x", str(tmp_path / "x.npy"), "--offs", "1,5",
                     "--out", str(tmp_path / "y.safetensors")]) == 0
    y = decode_safetensors((tmp_path / "y.safetensors").read_bytes())["y"]
    assert y.dtype == BFLOAT16
    ref = grouped_mm_ref(x, w, np.array([1, 4]))
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=3e-2, atol=3e-2)
    assert "offs" in server.seen[-1].tensors()
    capsys.readouterr()
    assert cli.main(["grouped-mm", "b", "--x", str(tmp_path / "x.npy"), "--counts", "1,x",
                     "--out", str(tmp_path / "y.npy")]) == 2
    assert cli.main(["grouped-mm", "b", "--x", str(tmp_path / "x.npy"), "--counts",
                     "99999999999999999999,0", "--out", str(tmp_path / "y.npy")]) == 2
    assert "outside int32" in capsys.readouterr().err  # was an OverflowError traceback
    assert cli.main(["grouped-mm", "b", "--x", str(tmp_path / "x.npy"), "--counts", "1,4",
                     "--out", str(tmp_path / "y.txt")]) == 2
    assert cli.main(["grouped-mm", "b", "--x", str(tmp_path / "nope.npy"), "--counts", "1,4",
                     "--out", str(tmp_path / "y.npy")]) == 2
    assert cli.main(["grouped-mm", "b", "--x", str(tmp_path / "x.npy"), "--counts", "2,4",
                     "--out", str(tmp_path / "y.npy")]) == 1  # server: 422
    assert "422" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["grouped-mm", "b", "--x", "x.npy", "--out", "y.npy"])  # counts or offs


def test_grouped_gemm_file(server, capsys, rng, tmp_path):
    a = [rng.standard_normal((m, k)).astype(np.float32) for m, k in [(3, 4), (0, 2), (5, 1)]]
    b = [rng.standard_normal((k, n)).astype(np.float32) for k, n in [(4, 6), (2, 3), (1, 7)]]
    tensors = {**{f"a.{i}": t for i, t in enumerate(a)}, **{f"b.{i}": t for i, t in enumerate(b)}}
    (tmp_path / "p.safetensors").write_bytes(encode_safetensors(tensors).to_bytes())
    assert cli.main(["grouped-gemm", "--in", str(tmp_path / "p.safetensors"), "--out",
                     str(tmp_path / "d.safetensors")]) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == 3
    d = decode_safetensors((tmp_path / "d.safetensors").read_bytes())
    for i in range(3):
        np.testing.assert_allclose(d[f"d.{i}"], a[i] @ b[i], rtol=1e-5, atol=1e-6)
    (tmp_path / "bad.safetensors").write_bytes(encode_safetensors({"a.0": a[0]}).to_bytes())
    assert cli.main(["grouped-gemm", "--in", str(tmp_path / "bad.safetensors"), "--out",
                     str(tmp_path / "d.safetensors")]) == 2


# Both spellings must act as the console script: `-m moe_gemm_client.cli` once imported the
# module, ran nothing and exited 0 (no __main__ guard), which a script cannot tell from success.
@pytest.mark.parametrize("module", ["moe_gemm_client", "moe_gemm_client.cli"])
def test_module_entry_point_runs(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.startswith("usage: moe-gemm-client")
    for cmd in ("health", "ready", "list", "upload", "delete", "grouped-mm"):
        assert cmd in out.stdout
    out = subprocess.run([sys.executable, "-m", module, "--url",
                          "http://127.0.0.1:9", "--max-retries", "0", "health"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "cannot reach" in out.stderr


# ------------------------------------------------------------------------------ bad input


def _usage_error(capsys, argv: list[str]) -> str:
    """argparse's refusal: exit 2, the last stderr line names the flag."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--timeout", "nan", "health"], "argument --timeout: must be a finite number of seconds"),
    (["--timeout", "inf", "health"], "argument --timeout: must be a finite number of seconds"),
    (["--timeout", "0", "health"], "argument --timeout: must be > 0 seconds, got '0'"),
    (["--timeout", "soon", "health"], "argument --timeout: expected seconds, got 'soon'"),
    (["ready", "--wait", "nan"], "argument --wait: must be a finite number of seconds"),
    (["ready", "--wait", "-5"], "argument --wait: must be >= 0 seconds, got '-5'"),
])
def test_duration_flags_are_checked_and_named(capsys, argv, expected):
    # was: "-5" accepted; "nan" reported later as "Invalid value NaN (not a number)"
    assert expected in _usage_error(capsys, argv)


def test_ready_wait_against_an_unreachable_server_exits_3(capsys, monkeypatch):
    """`ready` and `ready --wait` agree: 3 = unreachable, 1 = the server answered no."""
    handler, _ = sequence(*[httpx.ConnectError("refused")] * 1000)
    monkeypatch.setattr(cli, "_make_client", lambda args: make_client(handler, max_retries=0))
    assert cli.main(["ready", "--wait", "0.3"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: cannot reach")
    handler, _ = sequence(*[httpx.Response(503, json={"ready": False})] * 1000)
    monkeypatch.setattr(cli, "_make_client", lambda args: make_client(handler, max_retries=0))
    assert cli.main(["ready", "--wait", "0.3"]) == 1
    assert json.loads(capsys.readouterr().out) == {"ready": False}


def test_ready_wait_succeeds_once_the_server_comes_up(capsys, monkeypatch):
    handler, _ = sequence(httpx.ConnectError("refused"), httpx.Response(503, json={}),
                          httpx.Response(200, json={"ready": True}))
    monkeypatch.setattr(cli, "_make_client", lambda args: make_client(handler, max_retries=0))
    assert cli.main(["ready", "--wait", "10"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ready": True}


def test_a_directory_is_reported_as_a_directory(server, capsys, tmp_path):
    assert cli.main(["upload", "n", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: is a directory, not a file"
    assert cli.main(["grouped-mm", "n", "--x", str(tmp_path), "--counts", "1",
                     "--out", str(tmp_path / "y.npy")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: is a directory, not a file"
    assert cli.main(["grouped-gemm", "--in", str(tmp_path), "--out",
                     str(tmp_path / "d.safetensors")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: is a directory, not a file"


def test_unwritable_out_is_refused_before_the_request(server, capsys, rng, tmp_path):
    server.weights["l0"] = (rng.standard_normal((2, 4, 3)).astype(np.float32), "w")
    np.save(tmp_path / "x.npy", rng.standard_normal((3, 4)).astype(np.float32))
    sent = len(server.seen)
    bad = tmp_path / "nonexist" / "dir" / "y.npy"
    assert cli.main(["grouped-mm", "l0", "--x", str(tmp_path / "x.npy"), "--counts", "1,2",
                     "--out", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --out {bad}: no such directory {bad.parent}"
    assert ".tmp" not in err and len(server.seen) == sent  # nothing was sent
    (tmp_path / "out.npy").mkdir()
    assert cli.main(["grouped-mm", "l0", "--x", str(tmp_path / "x.npy"), "--counts", "1,2",
                     "--out", str(tmp_path / "out.npy")]) == 2
    assert f"--out {tmp_path / 'out.npy'}: is a directory" in capsys.readouterr().err
    assert cli.main(["grouped-gemm", "--in", str(tmp_path / "x.npy"), "--out",
                     str(tmp_path / "nonexist" / "d.safetensors")]) == 2
    assert "no such directory" in capsys.readouterr().err and len(server.seen) == sent


def test_save_failure_names_the_users_path(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.os, "replace", refuse)
    out = tmp_path / "y.npy"
    with pytest.raises(cli.UsageError) as e:
        cli.save_arrays(str(out), {"y": np.zeros(3)})
    assert str(e.value) == f"cannot write --out {out}: No space left on device"
    assert list(tmp_path.iterdir()) == []  # the temporary file is removed


def test_grouped_gemm_refuses_a_gap_in_the_numbering(server, capsys, rng, tmp_path):
    """a.0, b.0, a.2, b.2 used to run problem 0 alone and exit 0."""
    t = {k: rng.standard_normal((2, 2)).astype(np.float32) for k in ("a.0", "b.0", "a.2", "b.2")}
    path = tmp_path / "gap.safetensors"
    path.write_bytes(encode_safetensors(t).to_bytes())
    sent = len(server.seen)
    assert cli.main(["grouped-gemm", "--in", str(path), "--out",
                     str(tmp_path / "d.safetensors")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(server.seen) == sent
    assert err.strip() == (f"error: {path}: problems must be numbered a.0/b.0 .. a.N/b.N "
                           "without gaps; after the 1 problem(s) a.0..a.0 it holds a.2, b.2, "
                           "which would not be used")
    assert not (tmp_path / "d.safetensors").exists()


class _ClosedPipe(io.StringIO):
    """stdout whose reader went away (`moe-gemm-client list --json | head -1`)."""

    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_output_pipe_ends_quietly(server, capsys, monkeypatch, rng):
    server.weights["alpha"] = (rng.standard_normal((2, 3, 4)).astype(np.float32), "w")
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert cli.main(["list", "--json"]) == cli.EXIT_BROKEN_PIPE == 141
    assert capsys.readouterr().err == ""  # no "error: [Errno 32] Broken pipe"


@pytest.mark.parametrize("content", ["empty", "npz", "short_data"])
def test_an_unreadable_npy_is_a_usage_error(server, capsys, rng, tmp_path, content):
    """An empty file (np.load: EOFError) and a zip archive named .npy (np.load: an NpzFile,
    then an AttributeError) were tracebacks with exit 1."""
    server.weights["l0"] = (rng.standard_normal((2, 4, 3)).astype(np.float32), "w")
    x = rng.standard_normal((3, 4)).astype(np.float32)
    path = tmp_path / "x.npy"
    if content == "empty":
        path.write_bytes(b"")
    elif content == "npz":
        np.savez(tmp_path / "x.npz", x=x)
        path.write_bytes((tmp_path / "x.npz").read_bytes())
    else:
        np.save(path, x)
        path.write_bytes(path.read_bytes()[:-8])
    np.save(tmp_path / "x_ok.npy", x)
    sent = len(server.seen)
    for argv in (["--x", str(path), "--counts", "1,2"],
                 ["--x", str(tmp_path / "x_ok.npy"), "--counts", str(path)]):
        assert cli.main(["grouped-mm", "l0", *argv, "--out", str(tmp_path / "y.npy")]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"error: {path}: ") and err.count("\n") == 1
    assert len(server.seen) == sent


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:84267"])
def test_an_unusable_url_is_one_line_and_exit_2(capsys, url):
    """"http://[::1" was an httpx.InvalidURL traceback; a port past 65535 reached another
    port (getaddrinfo wraps it)."""
    assert cli.main(["--url", url, "health"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: base_url") and err.count("\n") == 1
