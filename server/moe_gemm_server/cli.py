"""`moe-gemm-server`: flags -> Settings -> uvicorn, with a graceful drain on SIGTERM/SIGINT.

Every flag has a MOE_GEMM_* environment variable (see config.py); a flag wins over the
variable. On the first SIGTERM or SIGINT the server does not stop listening: readiness turns
503 (so a load balancer stops sending), new requests get 503, queued and in-flight requests
finish (at most --drain-timeout-s), and only then uvicorn shuts down; the process exits 0. A
second signal stops at once.

A sticky device error (an illegal address: faults.py) turns the server not-ready and exits with
status 70 once the requests in flight are answered, so that the supervisor starts a new
process; the stored weight sets are loaded again on that start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import uvicorn
from pydantic import ValidationError

from . import __version__
from .config import Settings
from .faults import EXIT_DEVICE_FAILED
from .logs import configure_logging
from .security import check_exposure, check_tls

log = logging.getLogger("moe_gemm_server")


def _bool_flag(p: argparse.ArgumentParser, name: str, help: str) -> None:
    p.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction,
                   default=None, help=help)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-gemm-server",
        description="Batched grouped-GEMM inference over HTTP against resident MoE expert "
        "weights (native API + Open Inference Protocol v2). Every flag has a MOE_GEMM_<NAME> "
        "environment variable.",
    )
    a = p.add_argument
    a("--version", action="version", version=f"moe-gemm-server {__version__}")
    a("--host", help="interface to bind (default 127.0.0.1)")
    a("--port", type=int, help="port (default 8000; 0 = any free port)")
    a("--data-dir", help="where weight sets persist (default $XDG_DATA_HOME/moe-gemm-server; "
      "~/.local/share/moe-gemm-server where XDG_DATA_HOME is unset)")
    a("--sync-interval-s", type=float, help="rescan the data directory for sets other servers "
      "sharing it wrote or deleted, every this many seconds (default 2; 0 = never)")
    a("--api-key", action="append", help="accepted API key for matmul/read routes; repeatable "
      "(none = open)")
    a("--admin-key", help="key for weight uploads and deletes (required with a non-loopback "
      "--host)")
    a("--insecure-no-auth", action="store_true", default=None,
      help="allow a non-loopback --host without an admin key (warns at every start)")
    a("--ssl-certfile", help="serve HTTPS with this PEM certificate (chain)")
    a("--ssl-keyfile", help="the certificate's PEM private key (if not in --ssl-certfile)")
    a("--max-body-bytes", type=int, help="request body limit (default 64 MiB)")
    a("--max-weight-bytes", type=int, help="body limit of safetensors weight uploads (default "
      "16 GiB; JSON ones also take --max-body-bytes)")
    a("--body-timeout-s", type=float, help="longest pause while a request body arrives; past "
      "it: 408 and the connection is closed (default 60)")
    a("--max-rows", type=int, help="rows per request (default 65536)")
    a("--max-flops", type=int, help="FLOPs (2*M*N*K summed) per request (default 2^40)")
    a("--max-problems", type=int, help="problems per grouped-gemm request (default 4096)")
    a("--max-output-bytes", type=int, help="bytes of one request's result (default 1 GiB)")
    a("--max-resident-bytes", type=int, help="budget for resident weight sets on the device; "
      "an upload past it gets 507 (default: device memory)")
    a("--device", help="auto (default: cuda if available, else cpu), cpu, cuda, cuda:N")
    a("--backend", choices=["auto", "cute", "torch"], help="kernel backend (default auto)")
    # (engine_warmup.WarmUpMixin.warmup_rows_for: the heuristics' ladder on the cute backend,
    # one row on the torch backend whatever the device)
    a("--warmup-rows", help="comma-separated row counts each weight set is warmed at "
      "(default: on the cute backend, one per kernel configuration the heuristics can pick "
      "up to --max-rows; on the torch backend, on CPU or GPU alike, 1)")
    _bool_flag(p, "tune-at-start", "tune each weight set's kernel configs on this GPU before "
               "warming it (once per shape; cached on disk; default off)")
    _bool_flag(p, "batching", "merge concurrent requests into one launch (default on)")
    a("--batch-delay-us", type=int, help="how long the oldest request may wait for others "
      "to join its launch (default 0: only what queued during the previous launch)")
    a("--max-batch-rows", type=int, help="rows per launch (default 65536)")
    a("--max-batch-flops", type=int, help="FLOPs per launch (default 2^42)")
    a("--max-batch-requests", type=int, help="requests per launch (default 256)")
    a("--max-queue", type=int, help="queued requests before 429 (default 1024)")
    a("--default-timeout-us", type=int, help="timeout of requests that set none (default 0 = "
      "none)")
    a("--default-priority", type=int, help="priority level of requests with priority 0 "
      "(default 2; 1 is highest)")
    a("--drain-timeout-s", type=float, help="longest wait for queued work on shutdown "
      "(default 30)")
    a("--timeout-keep-alive", type=int, help="idle keep-alive seconds (default 5)")
    a("--log-level", choices=["critical", "error", "warning", "info", "debug"],
      help="log level (default info)")
    return p


def settings_from_args(argv: Sequence[str] | None = None) -> Settings:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return Settings(**overrides)
    except ValidationError as e:
        msgs = "; ".join(_setting_error(err) for err in e.errors())
        raise SystemExit(f"moe-gemm-server: invalid settings: {msgs}") from None


def _setting_error(err: Any) -> str:
    """`field (--flag): message` for one pydantic error: the user typed the flag (or its
    MOE_GEMM_ variable), so both names are given; pydantic's "Value error, " prefix of our own
    validators' messages is dropped."""
    loc = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:
        return msg
    return f"{loc} (--{str(err['loc'][0]).replace('_', '-')}): {msg}"


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the service before shutting down."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.exit_code = 0
        app.state.service.on_fatal = self.fail

    def fail(self, reason: str) -> None:
        """A sticky device error (faults.py): stop now and exit with EXIT_DEVICE_FAILED."""
        self.exit_code = EXIT_DEVICE_FAILED
        self.should_exit = True

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain_task is not None or self.should_exit:
            super().handle_exit(sig, frame)  # second signal: stop now
            if self._loop is not None:
                # uvicorn's own first signal would wait for open connections up to the
                # graceful-shutdown timeout (--drain-timeout-s), then drain again
                self.force_exit = True
            return
        # A signal handler runs in whatever context the main thread is in when the signal
        # lands, often a request's task: its request id would tag the drain's log lines. The
        # drain starts in a fresh context instead (call_soon_threadsafe would copy this one).
        self._loop.call_soon_threadsafe(self._start_drain, sig, context=contextvars.Context())

    def _start_drain(self, sig: int) -> None:
        if self._drain_task is None:
            log.info("received %s: draining", signal.Signals(sig).name)
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        service = self.app.state.service
        try:
            await service.drain(service.settings.drain_timeout_s)
        finally:
            self.should_exit = True


def _address(addr: tuple[Any, ...]) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int) -> list[socket.socket]:
    """Bound sockets for every address `host` resolves to (port 0: one free port for all).

    Bound before anything else starts, so that a busy port or an unknown host is refused with
    one line (uvicorn binds only after the app has started, and logs a failure as several).

    Raises:
        OSError: the host does not resolve or an address cannot be bound; the message names
            the address and the flags.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on --host {host!r}: {e.strerror}") from None
    sockets: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            if port == 0 and sockets:  # the same free port on every address
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio does: v6 sockets take v6 only
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                raise OSError(f"cannot listen on {_address(addr)} (--host/--port): "
                              f"{e.strerror or e}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _build_app(settings: Settings) -> Any:
    """The app with its engine built now: a device or backend that cannot run, or a data
    directory that cannot be used, is refused before serving starts. Raises SystemExit."""
    from .main import create_app
    from .service import build_engine

    try:
        engine = build_engine(settings)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"moe-gemm-server: {e}") from None
    try:
        return create_app(settings, engine=engine)
    except OSError as e:
        raise SystemExit(f"moe-gemm-server: cannot use --data-dir {settings.data_dir}: "
                         f"{e.strerror or e}") from None


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of `moe-gemm-server`.

    Every refusal to start (a flag value the settings refuse, a device or backend that cannot
    run here, an unusable data directory or TLS file, an address that cannot be bound) prints
    one line and exits 1. A flag argparse itself refuses (unknown, missing its value, not a
    number, not one of the choices) prints the usage line and the error and exits 2.
    """
    settings = settings_from_args(argv)
    configure_logging(settings.log_level)
    try:
        # exposure (a non-loopback bind needs an admin key) and TLS files: refused with one
        # line before the port is bound
        for warning in check_exposure(settings):
            log.warning("%s", warning)
        check_tls(settings)
    except (ValueError, OSError) as e:
        raise SystemExit(f"moe-gemm-server: {e}") from None
    try:
        sockets = listen(settings.host, settings.port)
    except OSError as e:
        raise SystemExit(f"moe-gemm-server: {e}") from None
    try:
        app = _build_app(settings)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=settings.timeout_keep_alive,
        # after the drain, a connection that still hangs (a stalled upload) is cut after this
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        lifespan="on",
        ssl_certfile=str(settings.ssl_certfile) if settings.ssl_certfile else None,
        ssl_keyfile=str(settings.ssl_keyfile) if settings.ssl_keyfile else None,
    )
    scheme = "https" if config.is_ssl else "http"
    for sock in sockets:
        log.info("listening on %s://%s", scheme, _address(sock.getsockname()))
    server = DrainingServer(config, app)
    server.run(sockets=sockets)
    if server.exit_code:
        sys.exit(server.exit_code)
    if not server.started:
        sys.exit(3)


if __name__ == "__main__":  # pragma: no cover
    main()
