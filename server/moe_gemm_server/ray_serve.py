"""moe-gemm-server replicas on Ray Serve (`pip install 'moe-gemm-server[ray]'`).

Ray Serve runs N copies of our FastAPI app, each in its own process with its own device
(`num_gpus` per replica: 1 puts one replica on each GPU), behind Ray's HTTP proxy, which
spreads requests over the replicas and restarts a replica whose health check fails. Every
replica is the whole server (native API, KServe v2, batching, auth, limits); Ray adds the
load balancing and the supervision.

    python -m moe_gemm_server.ray_serve --replicas 2 --num-gpus 1 -- \\
        --host 0.0.0.0 --port 8000 --data-dir /shared/moe-gemm --admin-key "$ADMIN"

Everything after `--` is moe-gemm-server's own flags (the same exposure, TLS-less and key
checks apply; TLS is Ray's proxy's business). The proxy listens on the server's --host and
--port.

Weight sets reach every replica through the shared data directory: replicas on one machine
share its disk, replicas on several machines need a shared file system mounted at the same
path. An upload lands on one replica, which stores it atomically; the others load it at their
next rescan (--sync-interval-s, default 2 s; see sync.py). Each answer carries an
`X-Replica` header naming the replica that served it.

A replica whose device hit a sticky CUDA error (faults.py) fails Ray's health check, and Ray
replaces it with a fresh process, which reloads the stored weight sets.

`deployment(settings, ...)` builds the Serve application for `serve.run` in your own driver.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from .config import Settings

log = logging.getLogger("moe_gemm_server")

try:  # optional dependency
    from ray import serve
except ImportError:  # pragma: no cover - exercised where ray is absent
    serve = None


def _require_ray() -> None:
    if serve is None:
        raise SystemExit("moe_gemm_server.ray_serve needs Ray Serve: pip install "
                         "'moe-gemm-server[ray]'")


class _ReplicaHeader:
    """ASGI wrapper adding `X-Replica: <id>` to every answer."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (b"x-replica", replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


class MoeGemmReplica:
    """One replica: the server's FastAPI app, built in the replica process."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = Settings(**settings)
        self.moe_app: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        from .logs import configure_logging
        from .main import create_app

        configure_logging(self.settings.log_level)
        self.moe_app = create_app(self.settings)
        # Ray's health check, not the process exit, replaces a replica with a dead device.
        self.moe_app.state.service.on_fatal = lambda reason: None
        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a replica (tests)
            replica = "local"
        return _ReplicaHeader(self.moe_app, replica)

    def check_health(self) -> None:
        """Ray calls this periodically; raising makes Ray replace the replica."""
        if self.moe_app is not None:
            fatal = self.moe_app.state.service.fatal_error
            if fatal is not None:
                raise RuntimeError(f"device failed: {fatal}")


def deployment(
    settings: Settings | dict[str, Any] | None = None,
    *,
    num_replicas: int = 2,
    num_gpus: float = 0.0,
    num_cpus: float = 1.0,
    name: str = "moe-gemm-server",
    **options: Any,
) -> Any:
    """The Ray Serve application: `num_replicas` replicas of the server.

    Args:
        settings: the servers' Settings (or a dict of its fields); None = from the
            environment (MOE_GEMM_*), read in the driver and passed to every replica.
        num_replicas: replicas (processes).
        num_gpus: GPUs per replica (1 = one replica per GPU; Ray sets CUDA_VISIBLE_DEVICES).
        num_cpus: CPUs Ray reserves per replica.
        name: the deployment's name.
        **options: more `serve.deployment` options (e.g. max_ongoing_requests).

    Returns:
        A bound Serve application for `serve.run(app, route_prefix="/")`.
    """
    _require_ray()
    if settings is None:
        settings = Settings()
    fields = settings.model_dump(mode="json") if isinstance(settings, Settings) else settings
    fields = {k: v for k, v in fields.items() if v is not None}
    Settings(**fields)  # fail in the driver, with the message, not in every replica
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1; got {num_replicas}")
    options.setdefault("max_ongoing_requests", 256)  # the server batches; let it see load
    options.setdefault("health_check_period_s", 2.0)
    # Ray stops a replica after this: let the server's own drain (--drain-timeout-s) finish
    drain = float(fields.get("drain_timeout_s", 30.0))
    options.setdefault("graceful_shutdown_timeout_s", drain + 5.0)
    cls = serve.ingress()(MoeGemmReplica)
    dep = serve.deployment(
        cls, name=name, num_replicas=num_replicas,
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": num_cpus}, **options,
    )
    return dep.bind(fields)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_gemm_server.ray_serve",
        description="Run N moe-gemm-server replicas on Ray Serve. Flags after '--' are "
        "moe-gemm-server's own (--host/--port are the Ray proxy's).",
    )
    p.add_argument("--replicas", type=int, default=2, help="replicas (default 2)")
    p.add_argument("--num-gpus", type=float, default=None,
                   help="GPUs per replica (default 1 where Ray sees GPUs, else 0)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica (default 1)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: start a local one)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    _require_ray()
    import ray

    from .cli import settings_from_args
    from .logs import configure_logging
    from .security import check_exposure

    args_list = list(sys.argv[1:] if argv is None else argv)
    split = args_list.index("--") if "--" in args_list else len(args_list)
    args = build_parser().parse_args(args_list[:split])
    settings = settings_from_args(args_list[split + 1:])
    configure_logging(settings.log_level)
    try:
        for warning in check_exposure(settings):
            log.warning("%s", warning)
    except ValueError as e:
        raise SystemExit(f"moe-gemm-server: {e}") from None
    if settings.ssl_certfile is not None:
        raise SystemExit("moe-gemm-server: under Ray Serve, TLS is terminated in front of "
                         "Ray's proxy (an ingress or load balancer); drop --ssl-certfile")
    ray.init(address=args.address, include_dashboard=False, logging_level=logging.WARNING)
    gpus = args.num_gpus
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    serve.start(http_options={"host": settings.host, "port": settings.port})
    app = deployment(settings, num_replicas=args.replicas, num_gpus=gpus,
                     num_cpus=args.num_cpus)
    serve.run(app, name="moe-gemm-server", route_prefix="/")
    log.info("%d replica(s) serving on http://%s:%d (%g GPU each)", args.replicas,
             settings.host, settings.port, gpus)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down the replicas")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":  # pragma: no cover
    main()
