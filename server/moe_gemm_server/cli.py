"""`moe-gemm-server`: flags -> Settings -> uvicorn, with a graceful drain on SIGTERM/SIGINT.

Every flag has a MOE_GEMM_* environment variable (see config.py); a flag wins over the
variable. On the first SIGTERM or SIGINT the server does not stop listening: readiness turns
503 (so a load balancer stops sending), new requests get 503, queued and in-flight requests
finish (at most --drain-timeout-s), and only then uvicorn shuts down; the process exits 0. A
second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import uvicorn
from pydantic import ValidationError

from . import __version__
from .config import Settings
from .logs import configure_logging

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
    a("--data-dir", help="where weight sets persist (default $XDG_DATA_HOME/moe-gemm-server)")
    a("--api-key", action="append", help="accepted API key for matmul/read routes; repeatable "
      "(none = open)")
    a("--admin-key", help="key for weight uploads and deletes")
    a("--max-body-bytes", type=int, help="request body limit (default 64 MiB)")
    a("--max-weight-bytes", type=int, help="body limit of weight uploads (default 16 GiB)")
    a("--max-rows", type=int, help="rows per request (default 65536)")
    a("--max-flops", type=int, help="FLOPs (2*M*N*K summed) per request (default 2^40)")
    a("--max-problems", type=int, help="problems per grouped-gemm request (default 4096)")
    a("--max-output-bytes", type=int, help="bytes of one request's result (default 1 GiB)")
    a("--device", help="auto (default: cuda if available, else cpu), cpu, cuda, cuda:N")
    a("--backend", choices=["auto", "cute", "torch"], help="kernel backend (default auto)")
    a("--warmup-rows", help="comma-separated row counts each weight set is warmed at "
      "(default: 1,64,512,4096 on CUDA, 1 on CPU)")
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
        msgs = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise SystemExit(f"moe-gemm-server: invalid settings: {msgs}") from None


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the service before shutting down."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain_task is not None or self.should_exit:
            super().handle_exit(sig, frame)  # second signal: stop now
            return
        log.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        service = self.app.state.service
        try:
            await service.drain(service.settings.drain_timeout_s)
        finally:
            self.should_exit = True


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of `moe-gemm-server`."""
    settings = settings_from_args(argv)
    configure_logging(settings.log_level)
    from moe_gemm_server.engine import resolve_device

    from .main import create_app

    try:
        resolve_device(settings.device)  # fail before binding the port, with one line
        app = create_app(settings)
    except (ValueError, OSError) as e:
        raise SystemExit(f"moe-gemm-server: {e}") from None
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
    )
    server = DrainingServer(config, app)
    server.run()
    if not server.started:
        sys.exit(3)


if __name__ == "__main__":  # pragma: no cover
    main()
