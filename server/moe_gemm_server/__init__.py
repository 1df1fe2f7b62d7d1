"""moe_gemm_server: resident expert weights and batched grouped-GEMM inference over HTTP.

FastAPI + uvicorn + pydantic around `moe_gemm_server.engine.Engine`: a native API (safetensors or
JSON bodies) and the Open Inference Protocol v2 (KServe / Triton, binary tensor extension),
a dynamic batcher that merges concurrent requests into one grouped launch, admission control,
persistence of weight sets, Prometheus metrics. The wire contract is docs/HTTP-API.md.

Start it with `moe-gemm-server` (or `python -m moe_gemm_server`); build the ASGI app yourself
with `create_app(Settings(...))`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import Settings
    from .main import create_app

__all__ = ["Settings", "create_app", "__version__"]


def __getattr__(name: str) -> Any:
    # create_app pulls in torch and the engine (~2-4 s), Settings pydantic (~0.5 s);
    # `moe-gemm-server --help` and `--version` import this package and must not pay for the
    # first, and the command line owns SIGINT and SIGTERM before either is imported.
    if name == "create_app":
        from .main import create_app

        return create_app
    if name == "Settings":
        from .config import Settings

        return Settings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
