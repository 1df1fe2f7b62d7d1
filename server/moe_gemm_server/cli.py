"""`moe-gemm-server`: flags -> Settings -> uvicorn, with a graceful drain on SIGTERM/SIGINT.

Every flag has a MOE_GEMM_* environment variable (see config.py); a flag wins over the
variable. On the first SIGTERM or SIGINT the server does not stop listening: readiness turns
503 (so a load balancer stops sending), new requests get 503, queued and in-flight requests
finish, and only then uvicorn shuts down, waiting for answers still being read with what is
left of the same --drain-timeout-s (at least 1 s); the process exits 0. A second signal stops
at once.

A signal before the server serves (while it imports, builds its engine, binds) stops the start
with one line and exit 0: the signals are the process's own from the first line of `main`
(start_signals.py). So that nothing of the start comes before that line, this module imports
at its top only what installing them needs (start_signals.py, standard library only);
everything else, argparse included, is imported once `main` runs (serving.py, the heavy part).

A sticky device error (an illegal address: faults.py) turns the server not-ready and exits with
status 70 once the requests in flight are answered, so that the supervisor starts a new
process; the stored weight sets are loaded again on that start.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from .start_signals import StartSignals

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from .config import Settings


def _bool_flag(p: argparse.ArgumentParser, name: str, help: str) -> None:
    import argparse

    p.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction,
                   default=None, help=help)


def build_parser() -> argparse.ArgumentParser:
    import argparse

    from . import __version__

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
    a("--default-timeout-us", type=int, help="timeout of requests that set none, and the "
      "longest one a request may set (default 0 = none)")
    a("--default-priority", type=int, help="priority level of requests with priority 0 "
      "(default 2; 1 is highest)")
    a("--drain-timeout-s", type=float, help="longest wait for queued work on shutdown "
      "(default 30)")
    a("--timeout-keep-alive", type=int, help="idle keep-alive seconds (default 5)")
    a("--log-level", choices=["critical", "error", "warning", "info", "debug"],
      help="log level (default info)")
    return p


def settings_from_args(argv: Sequence[str] | None = None) -> Settings:
    from pydantic import ValidationError

    from .config import Settings

    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return Settings(**overrides)
    except ValidationError as e:
        msgs = "; ".join(_setting_error(err, overrides) for err in e.errors())
        raise SystemExit(f"moe-gemm-server: invalid settings: {msgs}") from None


def _setting_error(err: Any, given: Collection[str] = ()) -> str:
    """`field (--flag): message` for one pydantic error where the flag was given (`given`: the
    fields set by flags), else `field (MOE_GEMM_FIELD): message` when the variable is set
    (the flag wins over it, so it is the one to fix; its value is not repeated, as it may be
    a key), else `field (--flag)`. pydantic's "Value error, " prefix of our own validators'
    messages is dropped."""
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:
        return msg
    loc = ".".join(str(p) for p in err["loc"])
    field = str(err["loc"][0])
    variable = f"MOE_GEMM_{field.upper()}"
    # (pydantic-settings matches variable names in any case, as os.environ holds them)
    env = {k.upper(): v for k, v in os.environ.items()}
    if field not in given and variable in env:
        return f"{loc} ({variable}): {msg}"
    return f"{loc} (--{field.replace('_', '-')}): {msg}"


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of `moe-gemm-server`.

    Every refusal to start (a flag value the settings refuse, a device or backend that cannot
    run here, an unusable data directory or TLS file, an address that cannot be bound) prints
    one line and exits 1. A flag argparse itself refuses (unknown, missing its value, not a
    number, not one of the choices) prints the usage line and the error and exits 2. A SIGINT
    or SIGTERM before the server serves stops the start: one line, exit 0 (start_signals.py).
    """
    start_signals = StartSignals()
    with start_signals.installed():  # (first: the imports below take about a second)
        settings = settings_from_args(argv)
        from .serving import serve

        serve(settings, start_signals)


if __name__ == "__main__":  # pragma: no cover
    main()
