"""Serving the command line's settings: bind, build the app, run uvicorn with a graceful drain.

`serve` binds the port first (a busy port or an unknown host is refused with one line before
anything else starts), then builds the engine and the app (a device, backend or data
directory that cannot be used is refused the same way), then runs `DrainingServer`: uvicorn,
whose first SIGTERM/SIGINT drains the service before shutting down (cli.py says what the
command line does around it).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import signal
import socket
import sys
import time
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

from .config import Settings
from .faults import EXIT_DEVICE_FAILED
from .logs import configure_logging
from .security import check_exposure, check_tls
from .start_signals import StartSignals

log = logging.getLogger("moe_gemm_server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the service before shutting down."""

    def __init__(self, config: uvicorn.Config, app: Any,
                 start_signals: StartSignals | None = None) -> None:
        super().__init__(config)
        self.app = app
        self.start_signals = start_signals
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

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, plus the signals received since the event loop was started and before
        uvicorn captured them (start_signals.py): one of them stops the server before it
        serves, as one during uvicorn's own start-up does."""
        with super().capture_signals():
            early = self.start_signals.take() if self.start_signals is not None else []
            if early:
                log.info("received %s while starting: stopping before serving",
                         signal.Signals(early[0]).name)
                self.should_exit = True
            yield

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
        timeout = service.settings.drain_timeout_s
        started = time.monotonic()
        try:
            await service.drain(timeout)
        finally:
            # uvicorn's own wait for open connections (answers still being read, a stalled
            # upload) comes after this drain: it gets what is left of --drain-timeout-s (at
            # least 1 s), so a stop takes about the drain timeout as documented, not twice it
            # (a slow reader of a 64 MiB answer kept a 5 s drain's process 9.9 s).
            left = timeout - (time.monotonic() - started)
            self.config.timeout_graceful_shutdown = max(1, math.ceil(left))
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


def serve(settings: Settings, start_signals: StartSignals) -> None:
    """Check, bind, build and serve `settings` until shut down. Every refusal to start is a
    SystemExit of one line; a signal before serving ends the process (start_signals)."""
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
        server = DrainingServer(config, app, start_signals)
        start_signals.hold()
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    scheme = "https" if config.is_ssl else "http"
    for sock in sockets:
        log.info("listening on %s://%s", scheme, _address(sock.getsockname()))
    server.run(sockets=sockets)
    if server.exit_code:
        sys.exit(server.exit_code)
    if not server.started:
        sys.exit(3)
