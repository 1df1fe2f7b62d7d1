"""`python -m moe_gemm_server.healthcheck`: exit 0 when the local server is ready, else 1.

The container's HEALTHCHECK. It asks GET /v2/health/ready where the server really listens: the
port (and host) come from the running server's own command line, found in /proc (in a container
PID 1, or the process under `docker run --init`), read with the server's own parser and its
precedence: flag > MOE_GEMM_* variable > default. So `docker run IMAGE --port 9000` and
`docker run -e MOE_GEMM_PORT=9000 IMAGE` are both probed on 9000; a server started on port 0
is probed on the port it listens on (its socket, found in /proc). It imports no torch (~0.3 s).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .config import Settings

SCRIPT = "moe-gemm-server"
MODULE = "moe_gemm_server"
# A wildcard bind is probed on the loopback address of its family.
_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def server_args(cmdline: Sequence[str]) -> list[str] | None:
    """The flags of a moe-gemm-server command line, or None if it is not one.

    Accepts the console script (`[python] .../moe-gemm-server ARGS`) and the module form
    (`python -m moe_gemm_server ARGS`).
    """
    for i, arg in enumerate(cmdline):
        if os.path.basename(arg) == SCRIPT:
            return list(cmdline[i + 1:])
        if arg == "-m" and i + 1 < len(cmdline) and cmdline[i + 1] == MODULE:
            return list(cmdline[i + 2:])
    return None


def find_server(proc: Path = Path("/proc")) -> list[str]:
    """The running server's flags: PID 1's if it is the server, else the lowest-numbered
    server process's; [] if none is found (then the variables and defaults decide)."""
    return find_server_process(proc)[1]


def find_server_process(proc: Path = Path("/proc")) -> tuple[int | None, list[str]]:
    """(pid, flags) of the running server as find_server picks it; (None, []) if none."""
    pids = sorted((int(p.name) for p in proc.iterdir() if p.name.isdigit()),
                  key=lambda pid: (pid != 1, pid)) if proc.is_dir() else []
    for pid in pids:
        try:
            raw = (proc / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        args = server_args([a.decode(errors="replace") for a in raw.split(b"\0") if a])
        if args is not None:
            return pid, args
    return None, []


def listening_port(proc: Path, pid: int) -> int | None:
    """The TCP port process `pid` listens on (its first listening socket in
    /proc/PID/net/tcp and tcp6), for a server started with --port 0 (a port the kernel
    picked); None where it cannot be read."""
    inodes = set()
    try:
        for fd in (proc / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    except OSError:
        return None
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / str(pid) / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # (sl, local address:port in hex, remote, state: 0A is LISTEN, ..., inode)
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:
                return int(f[1].rsplit(":", 1)[1], 16)
    return None


def ready_url(args: Sequence[str], env: Mapping[str, str] | None = None,
              port_zero: Callable[[], int | None] | None = None) -> str:
    """The readiness URL of a server started with `args` under environment `env`;
    `port_zero` gives the port a server started with port 0 listens on.

    Raises:
        ValueError: the port is not an integer in [1, 65535] (port 0: none found).
    """
    from .cli import build_parser  # the server's own flags (no torch)

    env = os.environ if env is None else env
    parsed, _ = build_parser().parse_known_args(list(args))
    fields = Settings.model_fields
    host = parsed.host if parsed.host is not None else env.get("MOE_GEMM_HOST",
                                                               fields["host"].default)
    port = parsed.port if parsed.port is not None else env.get("MOE_GEMM_PORT",
                                                               fields["port"].default)
    try:
        port = int(port)
    except ValueError:
        port = -1
    if port == 0 and port_zero is not None:
        port = port_zero() or 0
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer in [1, 65535]; got {port!r}")
    host = _LOOPBACK.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    # a server given a certificate serves HTTPS only: a plain-HTTP probe never gets an answer
    tls = parsed.ssl_certfile if parsed.ssl_certfile is not None else env.get(
        "MOE_GEMM_SSL_CERTFILE")
    scheme = "https" if tls else "http"
    return f"{scheme}://{host}:{port}/v2/health/ready"


def probe(url: str, timeout: float = 3.0) -> tuple[bool, str]:
    """(ready, what was seen) for one GET of `url`. An https URL is the server's own port on
    this host: its certificate (often self-signed, and not issued for the loopback address) is
    not verified."""
    context = None
    if url.startswith("https:"):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    # No proxy: urlopen would send the probe through $HTTP_PROXY / $HTTPS_PROXY (which Docker
    # sets in every container from the client's proxy settings) unless $NO_PROXY names the
    # host, and a proxy elsewhere cannot reach this container's own port.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(url, timeout=timeout) as r:  # noqa: S310 - local URL
            return r.status == 200, f"{r.status}"
    except urllib.error.HTTPError as e:
        return False, f"{e.code} {e.read(300).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as e:
        return False, str(getattr(e, "reason", e))
    except http.client.InvalidURL as e:  # a host no URL can hold ("a b")
        return False, str(e)


def main(proc: Path = Path("/proc")) -> None:
    pid, args = find_server_process(proc)
    try:
        url = ready_url(args, port_zero=None if pid is None else (
            lambda: listening_port(proc, pid)))
    except (ValueError, SystemExit) as e:
        print(f"moe-gemm-server healthcheck: cannot tell where the server listens: {e}",
              file=sys.stderr)
        sys.exit(1)
    ok, seen = probe(url)
    if not ok:
        print(f"moe-gemm-server healthcheck: {url}: {seen}", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
