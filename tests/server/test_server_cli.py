"""The `moe-gemm-server` command line: a fast --help/--version, one-line start-up refusals,
and a drain whose log lines carry no request id of the request the signal interrupted."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import uvicorn
from server_testutils import REPO

from moe_gemm_server import __version__
from moe_gemm_server.cli import main, settings_from_args
from moe_gemm_server.config import Settings, default_data_dir
from moe_gemm_server.logs import RequestIdFilter, request_id_var
from moe_gemm_server.serving import DrainingServer, listen

ENV_PATH = f"{REPO}:{REPO / 'server'}"


def _run(*args: str, code: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "moe_gemm_server",
                                                     *args]
    env = {"PYTHONPATH": ENV_PATH, "PATH": "/usr/bin:/bin"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_do_not_import_torch(flag):
    """Parsing comes first: --help and --version answer without importing torch (~3 s)."""
    code = ("import sys\nfrom moe_gemm_server.cli import main\n"
            f"try:\n    main([{flag!r}])\nexcept SystemExit as e:\n    assert e.code == 0, e\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    out = _run(code=code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("torch imported: False"), out.stdout
    if flag == "--version":
        assert out.stdout.splitlines()[0] == f"moe-gemm-server {__version__}"
    else:
        assert "--max-body-bytes" in out.stdout and "--backend" in out.stdout


# A child that sends itself `sig` when it first imports `module`: the signal lands at that
# exact step of the start, whatever this machine's speed.
_SIGNAL_AT_IMPORT = """
import importlib.abc, os, signal, sys
class SignalAt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.{sig})
        return None
sys.meta_path.insert(0, SignalAt())
from moe_gemm_server.cli import main
main({argv!r})
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("module, step", [
    # (imported at the command line module's top, before `main` ran, it met the defaults)
    ("argparse", "parsing the command line"),
    ("pydantic_settings", "reading the settings"),
    ("torch", "building the engine"),
    # imported by numpy's C extension as it initializes (torch imports numpy): an exception
    # raised there was swallowed, by torch's C code, and the next import of numpy failed
    # ("cannot load module more than once per process": a traceback and status 1)
    ("numpy.dtypes", "inside the import of a C extension"),
    ("uvicorn.loops.auto", "starting the event loop, before uvicorn holds the signals"),
])
def test_a_signal_while_starting_stops_it_cleanly(tmp_path, sig, module, step):
    """A signal in the first second or so of the start: SIGINT printed a KeyboardInterrupt
    traceback from wherever the start was (or, landing while asyncio's runner held SIGINT,
    was lost: the server started and served on), SIGTERM killed the process. Now the start
    stops with one line (or uvicorn's own start and stop, once its event loop runs), exit 0."""
    argv = ["--port", "0", "--data-dir", str(tmp_path / "data")]
    code = _SIGNAL_AT_IMPORT.format(module=module, sig=sig, argv=argv)
    out = _run(code=code, timeout=120)
    both = out.stdout + out.stderr
    assert out.returncode == 0, (step, out.returncode, both[-3000:])
    assert "Traceback" not in both, (step, both[-3000:])
    if module == "uvicorn.loops.auto":
        assert f"received {sig} while starting: stopping before serving" in both, both
        assert "Finished server process" in both
    else:
        assert out.stderr.strip().splitlines()[-1] == (
            f"moe-gemm-server: received {sig} while starting; stopped before serving"), both


# A child that sends itself `sig` from a finalizer run while it imports torch: Python prints
# an exception raised there ("Exception ignored in ...") and carries on.
_SIGNAL_IN_FINALIZER = """
import importlib.abc, os, signal, sys
class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.{sig})
        for _ in range(3):  # (the handler runs here, inside the finalizer)
            pass
class SignalAt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            Finalized()
        return None
sys.meta_path.insert(0, SignalAt())
from moe_gemm_server.cli import main
main({argv!r})
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_landing_in_a_finalizer_while_starting_prints_no_traceback(tmp_path, sig):
    """A signal whose handler runs inside a finalizer (or an import lock's callback, as a
    Ctrl-C during the start met at random): the exception the handler raised there was
    printed with its traceback ("Exception ignored in ..."), then the start stopped at its
    next step. Now the process ends there with the one line, exit 0."""
    argv = ["--port", "0", "--data-dir", str(tmp_path / "data")]
    out = _run(code=_SIGNAL_IN_FINALIZER.format(sig=sig, argv=argv), timeout=120)
    both = out.stdout + out.stderr
    assert out.returncode == 0, (out.returncode, both[-3000:])
    assert "Traceback" not in both and "Exception ignored" not in both, both[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"moe-gemm-server: received {sig} while starting; stopped before serving"], both


# The server's own modules that run before its handlers are installed: the package (its
# __init__), the two entry modules and the module that installs the handlers.
_OURS = ("moe_gemm_server", "moe_gemm_server.__main__", "moe_gemm_server.cli",
         "moe_gemm_server.start_signals")

# A child that starts the command as `start` does and logs every import from then on: the
# module's name, whether the command owns the signals yet (SIGTERM's handler: both are
# installed at once), and which of _OURS are being executed (importlib's
# `__spec__._initializing` while a module's code runs). At the first import made once the
# command owns the signals, it writes the log to `log_path` and sends itself `sig`, as early
# as a signal can meet the handlers.
_WATCH_THE_START = """
import importlib.abc, json, os, signal, sys
OURS = {ours!r}
log = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        owned = signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        running = [m for m in OURS
                   if getattr(getattr(sys.modules.get(m), "__spec__", None), "_initializing",
                              False)]
        log.append([name, owned, running])
        if owned:
            sys.meta_path.remove(self)
            with open({log_path!r}, "w") as f:
                json.dump(log, f)
            os.kill(os.getpid(), signal.{sig})
        return None
sys.meta_path.insert(0, Watch())
sys.argv = {argv!r}
{start}
"""


def _console_script_start() -> str:
    """What the `moe-gemm-server` script that pip writes from server/pyproject.toml runs.
    (Read with a pattern: tomllib is Python 3.11's, and the project runs on 3.10.)"""
    text = (REPO / "server" / "pyproject.toml").read_text()
    target = re.search(r'^moe-gemm-server\s*=\s*"([\w.]+):(\w+)"', text, re.MULTILINE)
    assert target is not None, "no moe-gemm-server entry point in server/pyproject.toml"
    module, func = target.groups()
    return f"from {module} import {func}\nsys.exit({func}())"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("entry", ["console script", "python -m"])
def test_the_signals_are_owned_before_any_import_of_the_start(tmp_path, entry, sig):
    """A signal in the first moments of the start, before `main` installed its handlers,
    met Python's defaults (a KeyboardInterrupt traceback, or death by SIGTERM): the command
    line module imported argparse at its top, before `main` ran. Now, from the moment the
    entry module runs, nothing is imported before the handlers are installed but the module
    that installs them; and a signal at the first import after that stops the start with the
    one line, exit 0."""
    start = (_console_script_start() if entry == "console script" else
             "import runpy\nrunpy.run_module('moe_gemm_server', run_name='__main__', "
             "alter_sys=True)")
    log_path = tmp_path / "imports.json"
    argv = ["moe-gemm-server", "--port", "0", "--data-dir", str(tmp_path / "data")]
    out = _run(code=_WATCH_THE_START.format(ours=_OURS, log_path=str(log_path), sig=sig,
                                            argv=argv, start=start))
    both = out.stdout + out.stderr
    assert out.returncode == 0, (out.returncode, both[-3000:])
    assert out.stderr.strip().splitlines() == [
        f"moe-gemm-server: received {sig} while starting; stopped before serving"], both
    log = json.loads(log_path.read_text())
    assert "moe_gemm_server.start_signals" in [name for name, _, _ in log], log
    # Imports while an entry module runs and the signals are not yet owned: none but the
    # handlers' module and its own (what the package's __init__ imports comes before any of
    # the command's code can run).
    entry_modules = {"moe_gemm_server.__main__", "moe_gemm_server.cli"}
    before = [name for name, owned, running in log
              if not owned and name not in _OURS and entry_modules & set(running)
              and "moe_gemm_server.start_signals" not in running]
    assert before == [], f"imported before the signals were owned: {before}"


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def _refusal(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    message = str(e.value.code)
    assert message.startswith("moe-gemm-server: ") and "\n" not in message, message
    return message


def test_every_start_up_refusal_is_one_line(tmp_path, restore_logging):
    data = str(tmp_path / "data")
    # --port 0 where the port is not the point: a server on 8000 (`make serve`) would be refused
    # first, by the bind
    msg = _refusal(["--device", "cpu", "--backend", "cute", "--port", "0", "--data-dir", data])
    assert "backend='cute' cannot run on cpu" in msg
    msg = _refusal(["--device", "cuda:99", "--port", "0", "--data-dir", data])
    assert "cuda:99" in msg
    msg = _refusal(["--host", "no-such-host.invalid", "--data-dir", data])
    assert "no-such-host.invalid" in msg and "admin key" in msg  # exposure is checked first
    msg = _refusal(["--host", "no-such-host.invalid", "--admin-key", "k" * 32,
                    "--data-dir", data])
    assert "--host 'no-such-host.invalid'" in msg
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        msg = _refusal(["--port", str(port), "--data-dir", data])
        assert f"127.0.0.1:{port}" in msg and "--port" in msg
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    msg = _refusal(["--device", "cpu", "--port", "0", "--data-dir", str(blocker / "data")])
    assert "--data-dir" in msg and str(blocker) in msg
    msg = _refusal(["--max-queue", "0"])
    assert "max_queue" in msg


@pytest.mark.parametrize("name,value", [("MOE_GEMM_TUNED_TABLES", "maybe"),
                                        ("MOE_GEMM_CHECK_OFFS", "bogus"),
                                        ("MOE_GEMM_FUSED", "flase"),
                                        ("MOE_GEMM_SPLIT_WAYS", "1"),
                                        ("MOE_GEMM_ROUTER", "triton")])
def test_a_library_variable_the_library_refuses_refuses_the_start(tmp_path, monkeypatch,
                                                                   restore_logging, name, value):
    # Most library variables are read only on a GPU call path: started anyway, the server's
    # every matmul there would fail and be answered as the client's fault.
    monkeypatch.setenv(name, value)
    msg = _refusal(["--device", "cpu", "--port", "0", "--data-dir", str(tmp_path / "data")])
    assert f"{name}={value!r}" in msg and "expected" in msg


def test_library_variables_the_library_takes_let_the_server_start(tmp_path, monkeypatch):
    for name, value in [("MOE_GEMM_TUNED_TABLES", "0"), ("MOE_GEMM_FUSED", "off"),
                        ("MOE_GEMM_SPLIT_WAYS", "4"), ("MOE_GEMM_ROUTER", "torch"),
                        ("MOE_GEMM_CHECK_OFFS", "")]:
        monkeypatch.setenv(name, value)
    from moe_gemm_server.config import Settings
    from moe_gemm_server.service import build_engine

    engine = build_engine(Settings(device="cpu", data_dir=tmp_path / "data"))
    assert engine.backend == "torch"


def test_a_refused_setting_names_the_variable_or_the_flag_that_set_it(monkeypatch,
                                                                      restore_logging):
    monkeypatch.setenv("MOE_GEMM_MAX_QUEUE", "0")
    msg = _refusal([])
    assert "max_queue (MOE_GEMM_MAX_QUEUE): " in msg and "--max-queue" not in msg, msg
    monkeypatch.setenv("MOE_GEMM_MAX_QUEUE", "5")  # the flag wins, and is the one named
    msg = _refusal(["--max-queue", "0"])
    assert "max_queue (--max-queue): " in msg and "MOE_GEMM_MAX_QUEUE" not in msg, msg
    monkeypatch.delenv("MOE_GEMM_MAX_QUEUE")
    monkeypatch.setenv("moe_gemm_port", "abc")  # (matched in any case, as pydantic reads it)
    msg = _refusal([])
    assert "port (MOE_GEMM_PORT): " in msg, msg
    monkeypatch.setenv("MOE_GEMM_ADMIN_KEY", "secret-key\x07")  # a key is never repeated
    msg = _refusal([])
    assert "admin_key (MOE_GEMM_ADMIN_KEY): " in msg and "secret-key" not in msg, msg


def test_refused_backend_in_a_real_process_prints_one_line(tmp_path):
    """What a user sees: one line on stderr, exit 1, no traceback, nothing bound."""
    out = _run("--device", "cpu", "--backend", "cute", "--data-dir", str(tmp_path / "d"),
               "--port", "0")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "moe-gemm-server:" in ln]
    assert lines == [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "backend='cute' cannot run on cpu" in lines[0]


def test_listen_binds_one_port_for_every_address():
    socks = listen("127.0.0.1", 0)
    try:
        assert len(socks) == 1 and socks[0].getsockname()[1] > 0
    finally:
        for s in socks:
            s.close()


def test_drain_after_a_signal_runs_outside_the_interrupted_request(caplog):
    """A signal handler runs in the context of whatever the main thread was doing, often a
    request's task; the drain it starts (and the drain's log lines) must not inherit that
    request's id."""
    seen: dict[str, str] = {}

    class FakeService:
        settings = SimpleNamespace(drain_timeout_s=1.0)

        async def drain(self, timeout: float) -> bool:
            seen["request_id"] = request_id_var.get()
            logging.getLogger("moe_gemm_server.service").info("draining: 0 queued")
            return True

    app = SimpleNamespace(state=SimpleNamespace(service=FakeService()))
    server = DrainingServer(uvicorn.Config(app=lambda scope, receive, send: None), app)
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestIdFilter())

    async def scenario() -> None:
        server._loop = asyncio.get_running_loop()

        async def request() -> None:
            request_id_var.set("req-in-flight")
            server.handle_exit(signal.SIGTERM, None)  # the signal lands during this request

        await asyncio.create_task(request())
        for _ in range(200):
            if server.should_exit:
                return
            await asyncio.sleep(0.005)

    asyncio.run(scenario())
    assert server.should_exit
    assert seen["request_id"] == "-"
    drain_lines = [r for r in caplog.records if "draining" in r.getMessage()]
    assert len(drain_lines) == 2  # "received SIGTERM: draining" and the service's own
    assert all(r.request_id == "-" for r in drain_lines), [
        (r.getMessage(), r.request_id) for r in drain_lines]


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_data_dir_is_refused_not_the_current_directory(tmp_path, value):
    """Path("") is Path("."): an empty --data-dir used to serve (and let admins delete) the
    .safetensors files of whatever directory the server was started in."""
    bystander = tmp_path / "model.safetensors"
    bystander.write_bytes(b"not ours")
    cmd = [sys.executable, "-m", "moe_gemm_server", "--port", "0", "--data-dir", value]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": ENV_PATH, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        "moe-gemm-server: invalid settings: data_dir (--data-dir): the data directory must be "
        "a non-empty path"], out.stderr
    assert bystander.read_bytes() == b"not ours"


def test_empty_data_dir_variable_is_refused_too(monkeypatch, restore_logging):
    monkeypatch.setenv("MOE_GEMM_DATA_DIR", "")
    msg = _refusal(["--port", "0"])
    assert "data_dir (MOE_GEMM_DATA_DIR): " in msg and "non-empty path" in msg


@pytest.mark.parametrize("field", ["ssl_certfile", "ssl_keyfile"])
@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_tls_variable_is_refused_naming_it(monkeypatch, restore_logging, tmp_path,
                                                   field, value):
    """MOE_GEMM_SSL_CERTFILE="" was Path(""), the current directory: the start was refused
    with "Is a directory", naming neither the variable nor the flag. Refused as an empty
    --data-dir is (read as unset, a template's empty certificate would serve plain HTTP)."""
    var, flag = f"MOE_GEMM_{field.upper()}", "--" + field.replace("_", "-")
    monkeypatch.setenv(var, value)
    msg = _refusal(["--port", "0", "--data-dir", str(tmp_path)])
    assert msg.startswith(f"moe-gemm-server: invalid settings: {field} ({var}): "), msg
    assert f"the path is empty ({flag} or {var})" in msg and "directory" not in msg, msg
    monkeypatch.delenv(var)
    msg = _refusal([flag, value, "--port", "0", "--data-dir", str(tmp_path)])
    assert f"the path is empty ({flag} or {var})" in msg, msg


@pytest.mark.parametrize("value", ["admin-key-0\n", "  admin-key-0\r\n", "\tadmin-key-0 "])
def test_the_admin_key_is_stripped_as_api_keys_are(monkeypatch, tmp_path, value):
    """A key read from a file or a secret ends in a newline: MOE_GEMM_API_KEY was stripped,
    MOE_GEMM_ADMIN_KEY refused the start ("printable ASCII without whitespace")."""
    monkeypatch.setenv("MOE_GEMM_ADMIN_KEY", value)
    monkeypatch.setenv("MOE_GEMM_API_KEY", value)
    s = settings_from_args(["--port", "0", "--data-dir", str(tmp_path)])
    assert s.admin_key == "admin-key-0" and s.api_key == ["admin-key-0"]
    monkeypatch.delenv("MOE_GEMM_ADMIN_KEY")
    assert settings_from_args(["--admin-key", value, "--data-dir", str(tmp_path)]
                              ).admin_key == "admin-key-0"
    monkeypatch.setenv("MOE_GEMM_ADMIN_KEY", "\n")  # (nothing but the newline: still refused)
    with pytest.raises(SystemExit) as e:
        settings_from_args(["--port", "0", "--data-dir", str(tmp_path)])
    assert "admin_key (MOE_GEMM_ADMIN_KEY): " in str(e.value.code)
    assert "non-empty printable ASCII" in str(e.value.code)


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--drain-timeout-s", "inf", "finite number"),  # was: OverflowError traceback
    ("--drain-timeout-s", "nan", "finite number"),
    ("--drain-timeout-s", "-1", "greater than or equal to 0"),
    ("--sync-interval-s", "inf", "finite number"),
    ("--sync-interval-s", "nan", "finite number"),
    ("--sync-interval-s", "-0.5", "greater than or equal to 0"),
    ("--body-timeout-s", "inf", "finite number"),
    ("--body-timeout-s", "nan", "finite number"),
    ("--body-timeout-s", "0", "greater than 0"),
])
def test_float_flags_refuse_non_finite_and_negative(tmp_path, restore_logging, flag, value,
                                                    expected):
    msg = _refusal([flag, value, "--port", "0", "--data-dir", str(tmp_path)])
    field = flag[2:].replace("-", "_")
    assert f"{field} ({flag}): " in msg and expected in msg, msg


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("default_timeout_us", 10**18, "below 10^18 microseconds"),
    ("default_timeout_us", 10**23, "below 10^18 microseconds"),
    ("batch_delay_us", 10**18, "below 10^18 microseconds"),
    ("max_queue", 1 << 32, "at most 4294967295"),
    ("max_queue", 10**23, "at most 4294967295"),
])
@pytest.mark.parametrize("source", ["flag", "variable"])
def test_settings_the_model_config_reports_are_bounded_at_start(tmp_path, monkeypatch,
                                                                 restore_logging, field, value,
                                                                 expected, source):
    """--default-timeout-us and --batch-delay-us (Triton's uint64 microseconds, bounded as a
    request's own X-Timeout-Us is) and --max-queue (Triton's uint32 max_queue_size) had no
    upper bound: 10^23 or 2^32 started, and /v2/models/{name}/config then reported a number
    Triton's ModelConfig cannot hold, so that page no longer parsed as one."""
    flag = f"--{field.replace('_', '-')}"
    argv = ["--port", "0", "--data-dir", str(tmp_path)]
    if source == "flag":
        argv += [flag, str(value)]
        named = flag
    else:
        named = f"MOE_GEMM_{field.upper()}"
        monkeypatch.setenv(named, str(value))
    with pytest.raises(SystemExit) as e:
        settings_from_args(argv)
    msg = str(e.value.code)
    assert msg.startswith(f"moe-gemm-server: invalid settings: {field} ({named}): "), msg
    assert expected in msg and "\n" not in msg, msg


def test_the_largest_bounded_settings_are_taken(tmp_path):
    s = settings_from_args(["--default-timeout-us", str(10**18 - 1), "--batch-delay-us",
                            str(10**18 - 1), "--max-queue", str((1 << 32) - 1),
                            "--data-dir", str(tmp_path)])
    assert (s.default_timeout_us, s.batch_delay_us, s.max_queue) == (10**18 - 1, 10**18 - 1,
                                                                      (1 << 32) - 1)


def test_a_huge_setting_in_a_real_process_is_one_line_and_exit_1(tmp_path):
    out = _run("--max-queue", str(1 << 32), "--port", "0", "--data-dir", str(tmp_path),
               timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "moe-gemm-server: invalid settings: max_queue (--max-queue): must be at most"), lines


def test_drain_timeout_inf_in_a_real_process_is_one_line(tmp_path):
    out = _run("--drain-timeout-s", "inf", "--port", "0", "--data-dir", str(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        "moe-gemm-server: invalid settings: drain_timeout_s (--drain-timeout-s): Input should "
        "be a finite number"]


def test_parser_errors_print_usage_and_exit_2(tmp_path):
    """What server/README.md documents: argparse's own refusals are usage + one error line,
    exit 2 (the settings' refusals are one line, exit 1)."""
    out = _run("--port", "eighty", "--data-dir", str(tmp_path))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("usage: moe-gemm-server")
    assert lines[-1] == "moe-gemm-server: error: argument --port: invalid int value: 'eighty'"
    readme = (REPO / "server" / "README.md").read_text()
    assert "exits 2" in readme and "exits 1" in readme


def test_help_describes_the_warmup_default_the_engine_uses(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "1,64,512,4096" not in text  # the old, wrong default
    assert "on the cute backend, one per kernel configuration" in text
    assert "on the torch backend, on CPU or GPU alike, 1" in text


def test_help_and_readme_name_the_data_dir_default_without_xdg_data_home(capsys, monkeypatch):
    """Most machines have no XDG_DATA_HOME: the default they get must be written out too."""
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert default_data_dir() == Path("/home/someone/.local/share/moe-gemm-server")
    with pytest.raises(SystemExit):
        main(["--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps at hyphens too
    assert "~/.local/share/moe-gemm-serverwhereXDG_DATA_HOMEisunset" in text
    readme = (REPO / "server" / "README.md").read_text()
    assert "`~/.local/share/moe-gemm-server`" in readme


@pytest.mark.parametrize("flag", ["--api-key", "--admin-key"])
@pytest.mark.parametrize("key", ["cl\u00e9", "k\x01ey", "\u5bc6\u94a5"])
def test_keys_beyond_printable_ascii_are_refused_at_start(tmp_path, flag, key):
    """A key arrives in an Authorization header: curl sends a non-ASCII key as UTF-8 bytes,
    which the server reads as Latin-1, and moe_gemm_client refuses to send one. Such a key
    was accepted at start and then matched no request (every call a 403)."""
    with pytest.raises(SystemExit) as e:  # (the settings alone: a start never begins)
        settings_from_args([flag, key, "--port", "0", "--data-dir", str(tmp_path)])
    msg = str(e.value.code)
    assert msg.startswith("moe-gemm-server: ") and "\n" not in msg, msg
    field = flag[2:].replace("-", "_")
    assert f"{field} ({flag}): " in msg and "printable ASCII" in msg, msg


def test_printable_ascii_keys_are_taken(tmp_path):
    s = Settings(api_key=["r-1:x/y+z=="], admin_key="A~b!c", data_dir=tmp_path)
    assert s.api_key == ["r-1:x/y+z=="] and s.admin_key == "A~b!c"


@pytest.mark.parametrize("value", [",", " , ,"])
def test_an_api_key_variable_of_commas_alone_is_refused(monkeypatch, restore_logging, tmp_path,
                                                        value):
    """MOE_GEMM_API_KEY="," split into no key at all and started a server with its matmul and
    read routes open, where keys were asked for."""
    monkeypatch.setenv("MOE_GEMM_API_KEY", value)
    with pytest.raises(SystemExit) as e:  # (the settings alone: a start never begins)
        settings_from_args(["--port", "0", "--data-dir", str(tmp_path)])
    msg = str(e.value.code)
    assert msg.startswith("moe-gemm-server: ") and "\n" not in msg, msg
    assert "api_key (MOE_GEMM_API_KEY): " in msg and "names no key" in msg, msg
    monkeypatch.setenv("MOE_GEMM_API_KEY", "")  # empty: no keys, as before
    assert Settings(data_dir=tmp_path).api_key == []
    monkeypatch.setenv("MOE_GEMM_API_KEY", "a,,b ,")
    assert Settings(data_dir=tmp_path).api_key == ["a", "b"]


@pytest.mark.parametrize("argv,env", [
    (["--warmup-rows", "10000000000"], {}),
    (["--warmup-rows", "1,70000"], {}),
    (["--max-rows", "64", "--max-batch-rows", "128", "--warmup-rows", "129"], {}),
    ([], {"MOE_GEMM_WARMUP_ROWS": "100000"}),
])
def test_warmup_rows_beyond_any_launch_are_refused_at_start(tmp_path, monkeypatch, argv, env):
    """A warm-up row count above max(--max-rows, --max-batch-rows) warms nothing a launch can
    use. 10000000000 (a typo) was accepted: the server came up ready with every stored set
    failed to load (its warm-up could not allocate the input) and answered every upload 500."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # (the settings alone: before the check, main() went on to serve and never returned)
    with pytest.raises(SystemExit) as e:
        settings_from_args([*argv, "--port", "0", "--data-dir", str(tmp_path)])
    msg = str(e.value.code)
    assert "\n" not in msg
    assert msg.startswith("moe-gemm-server: invalid settings: warmup_rows (--warmup-rows): "), msg
    assert "more rows than one launch can carry" in msg, msg


def test_warmup_rows_up_to_the_launch_limit_are_taken(tmp_path):
    s = settings_from_args(["--max-rows", "64", "--max-batch-rows", "128",
                            "--warmup-rows", "1,128", "--data-dir", str(tmp_path)])
    assert s.warmup_rows == [1, 128]


@pytest.mark.parametrize("value", ["1,,2", "16,", ",8"])
def test_warmup_rows_with_a_stray_comma_are_refused(tmp_path, value):
    # The empty item was dropped: "1,,2" started a server warming [1, 2] without a word.
    with pytest.raises(SystemExit) as e:
        settings_from_args(["--warmup-rows", value, "--port", "0", "--data-dir", str(tmp_path)])
    msg = str(e.value.code)
    assert msg.startswith("moe-gemm-server: invalid settings: warmup_rows") and "\n" not in msg
    assert settings_from_args(["--warmup-rows", " 16, 64 ", "--data-dir", str(tmp_path)]
                              ).warmup_rows == [16, 64]


@pytest.mark.parametrize("drain_s, spent_s, left_s", [(30.0, 0.0, 30), (3.0, 2.2, 1),
                                                      (1.0, 1.0, 1)])
def test_uvicorn_waits_only_what_is_left_of_the_drain_timeout(drain_s, spent_s, left_s):
    """After the drain, uvicorn waits for open connections (answers still being read) up to
    its graceful timeout, which was the whole --drain-timeout-s again: a stop could take
    twice the documented bound (and past the manifests' grace periods). It is now what the
    drain left of it, at least 1 s."""
    class FakeService:
        settings = SimpleNamespace(drain_timeout_s=drain_s)

        async def drain(self, timeout: float) -> bool:
            await asyncio.sleep(spent_s)
            return True

    app = SimpleNamespace(state=SimpleNamespace(service=FakeService()))
    server = DrainingServer(uvicorn.Config(app=lambda scope, receive, send: None,
                                           timeout_graceful_shutdown=int(drain_s)), app)
    asyncio.run(server._drain())
    assert server.should_exit and server.config.timeout_graceful_shutdown == left_s
